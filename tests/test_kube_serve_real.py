"""`kmend serve --cluster kube` against the real API server KMEND_TEST_KUBECONFIG names (skipped without one).

As an operator deploys it: the shipped ClusterRole and bindings applied, kmend authenticated as the
`kmend-system/kmend` ServiceAccount with a token from TokenRequest, `KMEND_EVENT_NAMESPACE=kmend-system`.
An Xid 79 in a signal batch, and the node is cordoned, tainted, labelled, conditioned and evented (in
`default`), the job's pod evicted, its 4-rank gang rebound by kmend's scheduler on healthy nodes plus a spare,
and the plan ends `succeeded` with no 403 in kmend's log. A bare API server runs no controllers: the test
plays the kubelet (terminating pods finish, bound pods run), the training operator (missing ranks come back
pending), the platform (repair done) and the Job controller (the health check passes), all with the
kubeconfig's own (admin) credentials. It creates its own nodes (its pods select only them, whatever else the
cluster has), namespace and PyTorchJob CRD if absent, and removes the nodes and namespace afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from collector.wire import to_wire
from tests.builders import XID79, container, kernel
from tests.conftest import free_port
from tests.procs import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parent.parent
GPU_NODE = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8", "pods": "110"}
TOKENS = {"KMEND_INGEST_TOKEN": "ingest-t", "KMEND_OPERATOR_TOKEN": "op-t", "KMEND_READER_TOKEN": "read-t"}


@pytest.fixture
def admin() -> Iterator[Any]:
    path = os.environ.get("KMEND_TEST_KUBECONFIG")
    if not path:
        pytest.skip("KMEND_TEST_KUBECONFIG is not set: no real API server to run kmend serve against")
    from kubernetes import config

    api = config.new_client_from_config(config_file=path)
    yield api
    api.close()


def _ok_if_exists(fn: Callable[..., Any], *args: Any) -> None:
    from kubernetes import client

    try:
        fn(*args)
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def _install(api: Any, namespace: str) -> str:
    """The shipped RBAC (ClusterRole, Roles and their bindings), kmend's ServiceAccount, the job's namespace and
    the PyTorchJob CRD; kmend's token."""
    from kubernetes import client

    core, rbac, ext = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api), client.ApiextensionsV1Api(api)
    for ns in ("kmend-system", namespace):
        _ok_if_exists(core.create_namespace, {"metadata": {"name": ns}})
        _ok_if_exists(core.create_namespaced_service_account, ns, {"metadata": {"name": "default"}})
    _ok_if_exists(core.create_namespaced_service_account, "kmend-system", {"metadata": {"name": "kmend"}})
    for doc in yaml.safe_load_all((REPO / "deploy" / "service" / "kmend.yaml").read_text()):
        if doc and doc["kind"] == "ClusterRole":
            _ok_if_exists(rbac.create_cluster_role, doc)
            rbac.replace_cluster_role(doc["metadata"]["name"], doc)  # the shipped rules, not an older copy
        elif doc and doc["kind"] == "ClusterRoleBinding":
            _ok_if_exists(rbac.create_cluster_role_binding, doc)
        elif doc and doc["kind"] == "Role":
            ns = doc["metadata"]["namespace"]
            _ok_if_exists(rbac.create_namespaced_role, ns, doc)
            rbac.replace_namespaced_role(doc["metadata"]["name"], ns, doc)
        elif doc and doc["kind"] == "RoleBinding":
            _ok_if_exists(rbac.create_namespaced_role_binding, doc["metadata"]["namespace"], doc)
    _ok_if_exists(ext.create_custom_resource_definition, {"metadata": {"name": "pytorchjobs.kubeflow.org"}, "spec": {
        "group": "kubeflow.org", "scope": "Namespaced",
        "names": {"plural": "pytorchjobs", "kind": "PyTorchJob", "singular": "pytorchjob"},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object",
                                                     "x-kubernetes-preserve-unknown-fields": True}}}]}})
    deadline = time.monotonic() + 30
    while True:  # the CRD is served shortly after it is established
        try:
            client.CustomObjectsApi(api).list_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs")
            break
        except client.ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    request = core.create_namespaced_service_account_token("kmend", "kmend-system", {"spec": {}})
    return str(request.status.token)


class Cluster:
    """The nodes, the job and what the controllers of a full cluster would do, through the admin client."""

    def __init__(self, api: Any, namespace: str, run: str) -> None:
        from kubernetes import client

        self.core, self.custom, self.batch = client.CoreV1Api(api), client.CustomObjectsApi(api), client.BatchV1Api(api)
        self.ns, self.run = namespace, run
        self.recreated = 0
        self.owner: dict[str, Any] = {}

    def node(self, i: int) -> str:
        return f"kmend-real-{self.run}-{i}"

    def build(self) -> None:
        for i in range(6):  # four job nodes, two hot spares
            labels = {"topology.kmend.io/leaf": f"leaf-{i // 4}", "topology.kmend.io/spine": "spine-0",
                      "kmend.io/test-run": self.run}
            if i >= 4:
                labels["kmend.io/spare"] = "true"
            self.core.create_node({"metadata": {"name": self.node(i), "labels": labels}})
            self.core.patch_node_status(self.node(i), {"status": {"allocatable": GPU_NODE, "capacity": GPU_NODE,
                                                                  "conditions": [{"type": "Ready", "status": "True",
                                                                                  "reason": "KubeletReady"}]}})
            spare = [{"key": "kmend.io/spare", "value": "true", "effect": "NoSchedule"}] if i >= 4 else []
            self.core.patch_node(self.node(i), {"spec": {"taints": spare}})  # not-ready goes, as for a Ready kubelet
        job = self.custom.create_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs", {
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "llama"}, "spec": {}})
        self.owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama",
                      "uid": job["metadata"]["uid"], "controller": True}
        for rank in range(4):
            self.pod(rank, self.node(rank))

    def pod(self, rank: int, node: str) -> None:
        resources = {"requests": {"nvidia.com/gpu": "8", "cpu": "8"}, "limits": {"nvidia.com/gpu": "8"}}
        spec: dict[str, Any] = {"schedulerName": "kmend", "nodeSelector": {"kmend.io/test-run": self.run},
                                "containers": [{"name": "c", "image": "busybox", "resources": resources}]}
        if node:
            spec["nodeName"] = node
        self.core.create_namespaced_pod(self.ns, {"metadata": {
            "name": f"llama-worker-{rank}", "ownerReferences": [self.owner],
            "labels": {"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-index": str(rank),
                       "kmend.io/job": "llama", "scheduling.x-k8s.io/pod-group": "llama"}}, "spec": spec})
        if node:
            self.core.patch_namespaced_pod_status(f"llama-worker-{rank}", self.ns, {"status": {"phase": "Running"}})

    def tick(self) -> None:
        from kubernetes import client

        for p in self.core.list_namespaced_pod(self.ns).items:
            if p.metadata.deletion_timestamp:  # the kubelet stopped the containers
                _ignore_404(self.core.delete_namespaced_pod, p.metadata.name, self.ns, grace_period_seconds=0)
        present = {p.metadata.name for p in self.core.list_namespaced_pod(self.ns).items}
        for rank in range(4):
            if f"llama-worker-{rank}" not in present:  # the operator recreates a missing replica, unbound
                self.pod(rank, "")
                self.recreated += 1
        for p in self.core.list_namespaced_pod(self.ns).items:
            if p.spec.node_name and p.status.phase == "Pending":
                self.core.patch_namespaced_pod_status(p.metadata.name, self.ns, {"status": {"phase": "Running"}})
        for i in range(6):
            ann = self.core.read_node(self.node(i)).metadata.annotations or {}
            req = ann.get("kmend.io/repair-request")
            if req and ann.get("kmend.io/repair-done") != req.split(":", 1)[1]:  # the platform replaced it
                self.core.patch_node(self.node(i), {"metadata": {"annotations": {
                    "kmend.io/repair-done": req.split(":", 1)[1]}}})
        for j in self.batch.list_namespaced_job("kmend-system").items:
            if j.metadata.name.startswith("kmend-validate-") and not (j.status and j.status.succeeded):
                try:
                    self.batch.patch_namespaced_job_status(j.metadata.name, "kmend-system",
                                                           {"status": {"succeeded": 1}})
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise

    def remove(self) -> None:
        for i in range(6):
            _ignore_404(self.core.delete_node, self.node(i))
        for p in self.core.list_namespaced_pod(self.ns).items:
            _ignore_404(self.core.delete_namespaced_pod, p.metadata.name, self.ns, grace_period_seconds=0)
        _ignore_404(self.core.delete_namespace, self.ns)


def _ignore_404(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    from kubernetes import client

    try:
        fn(*args, **kwargs)
    except client.ApiException as exc:
        if exc.status != 404:
            raise


def _until(what: str, pred: Callable[[], Any], timeout: float, tick: Callable[[], None] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if got := pred():
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_serve_on_a_real_api_server_heals_an_xid79_end_to_end(admin: Any, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:6]
    namespace = f"kmend-real-{run}"
    token = _install(admin, namespace)
    world = Cluster(admin, namespace, run)
    cfg = admin.configuration
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "real",
        "clusters": [{"name": "real", "cluster": {"server": cfg.host, "certificate-authority": cfg.ssl_ca_cert}
                      if cfg.ssl_ca_cert else {"server": cfg.host, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "kmend", "user": {"token": token}}],
        "contexts": [{"name": "real", "context": {"cluster": "real", "user": "kmend"}}]}))
    policy = yaml.safe_load((REPO / "healer" / "policies" / "default.yaml").read_text())
    policy["defaults"]["drain_grace_s"] = 5
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    port = free_port()
    env = {**os.environ, **TOKENS, "KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig),
           "KMEND_EVENT_NAMESPACE": "kmend-system", "KMEND_PORT": str(port),
           "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}", "KMEND_POLICY_FILE": str(tmp_path / "policy.yaml"),
           "KMEND_HEALER_INTERVAL_S": "0.1", "KMEND_SCHEDULER_INTERVAL_S": "0.1", "KMEND_SYMPTOM_SETTLE_S": "0"}
    log = tmp_path / "serve.log"
    proc = None
    try:
        world.build()
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, stdout=fh,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, log=log)
        bad = world.node(1)
        r = httpx.post(f"{url}/v1/signals", headers={"authorization": "Bearer ingest-t"}, timeout=10, json={
            "signals": [to_wire(container(bad, "step 100 loss 2.1", job="llama", rank=1, pod="llama-worker-1",
                                               namespace=namespace)),
                        to_wire(kernel(bad, XID79))]})
        assert r.status_code == 200, r.text
        _until("the node cordoned, tainted, labelled and conditioned", lambda: (
            (n := world.core.read_node(bad)).spec.unschedulable
            and any(t.key == "kmend.io/fault" for t in n.spec.taints or [])
            and (n.metadata.labels or {}).get("kmend.io/quarantined") == "true"
            and any(c.type == "KmendHealthy" and c.status == "False" for c in n.status.conditions or [])),
            timeout=60)

        def plan() -> dict[str, Any] | None:
            plans = httpx.get(f"{url}/v1/plans", headers={"authorization": "Bearer op-t"}, timeout=5).json()["plans"]
            return plans[0] if plans else None

        final = _until("the plan to finish", lambda: (p := plan()) and p["state"] in ("succeeded", "failed") and p,
                       timeout=240, tick=world.tick)
        steps = [(s["kind"], s["state"], s["result"]) for s in final["steps"]]
        assert final["state"] == "succeeded", steps
        events = [e for e in world.core.list_namespaced_event("default").items if e.involved_object.name == bad]
        assert "KmendQuarantine" in {e.reason for e in events}
        bound = {p.metadata.name: p.spec.node_name for p in world.core.list_namespaced_pod(namespace).items}
        assert world.recreated >= 1 and len(bound) == 4 and all(bound.values()) and bad not in bound.values(), bound
        assert {world.node(4), world.node(5)} & set(bound.values()), bound
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text()[-4000:] if log.exists() else ''}") from None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)
        world.remove()
    forbidden = [line for line in log.read_text().splitlines() if "Forbidden" in line or "(403)" in line]
    assert forbidden == [], forbidden[:5]
