"""`kmend serve --cluster kube` as an operator runs it, against the loopback API server with the shipped ClusterRole
enforced (403 for anything it does not grant) and `KMEND_EVENT_NAMESPACE=kmend-system` as the Deployment sets it:
one Xid 79 in a signal batch, and the node is cordoned, tainted, labelled, conditioned and evented (in `default`),
the job's pod on it evicted, its gang rebound by kmend's own scheduler on healthy nodes plus a spare, and the plan
ends `succeeded`. The fake runs no controllers: the test plays the kubelet (terminating pods finish), the
PyTorchJob controller (deleted pods come back pending) and the platform (repair done, health-check Job passes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from tests.builders import XID79, container, kernel
from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.procs import kube_serve_env, start_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "service" / "kmend.yaml"
NS = "training"
SA_TOKEN = "sa-token-kmend"
TOKENS = {"KMEND_INGEST_TOKEN": "ingest-t", "KMEND_OPERATOR_TOKEN": "op-t", "KMEND_READER_TOKEN": "read-t"}
GPU_NODE = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8", "pods": "110"}


def _until(what: str, pred: Callable[[], Any], timeout: float = 90.0, tick: Callable[[], None] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _world(api: FakeApiServer) -> list[str]:
    names = []
    for i in range(6):  # four job nodes, two hot spares: a replacement has nowhere to go but a spare
        name = f"gpu-{i}"
        labels = {"topology.kmend.io/leaf": f"leaf-{i // 4}", "topology.kmend.io/spine": "spine-0"}
        if i >= 4:
            labels["kmend.io/spare"] = "true"
        api.add_node(name, labels)
        api.nodes[name]["status"]["allocatable"] = dict(GPU_NODE)
        api.nodes[name]["status"]["capacity"] = dict(GPU_NODE)
        if i >= 4:
            api.nodes[name]["spec"]["taints"] = [{"key": "kmend.io/spare", "value": "true", "effect": "NoSchedule"}]
        names.append(name)
    api.install_kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
    job = api.add_object("kubeflow.org", "v1", "pytorchjobs", NS, {"metadata": {"name": "llama"}})
    owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama",
             "uid": job["metadata"]["uid"], "controller": True}
    for r in range(4):
        _pod(api, r, f"gpu-{r}", owner, phase="Running")
    return names


def _pod(api: FakeApiServer, rank: int, node: str, owner: dict[str, Any], phase: str) -> None:
    api.add_pod(NS, f"llama-worker-{rank}", scheduler="kmend", node=node, phase=phase,
                requests={"nvidia.com/gpu": "8", "cpu": "8"}, owners=[owner],
                labels={"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-index": str(rank),
                        "kmend.io/job": "llama", "scheduling.x-k8s.io/pod-group": "llama"})


class Controllers:
    """What a kubelet, the training operator and the platform would do on a real cluster."""

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.recreated = 0

    def tick(self) -> None:
        api = self.api
        for (ns, name), p in list(api.pods.items()):
            if p["metadata"].get("deletionTimestamp"):
                api.finish_termination(ns, name)  # the kubelet stopped the containers
        present = {name for (ns, name) in api.pods if ns == NS}
        job = api.object("kubeflow.org", "v1", "pytorchjobs", NS, "llama")
        if job is None:
            return
        owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama",
                 "uid": job["metadata"]["uid"], "controller": True}
        for r in range(4):
            if f"llama-worker-{r}" not in present:  # the operator recreates a missing replica, unbound
                _pod(api, r, "", owner, phase="Pending")
                self.recreated += 1
        for (ns, name), p in list(api.pods.items()):
            if p["spec"].get("nodeName") and p["status"].get("phase") == "Pending":
                api.set_phase(ns, name, "Running")
        for node in api.nodes.values():  # the platform replaced the hardware it was asked to
            ann = node["metadata"].setdefault("annotations", {})
            req = ann.get("kmend.io/repair-request")
            if req and ann.get("kmend.io/repair-done") != req.split(":", 1)[1]:
                ann["kmend.io/repair-done"] = req.split(":", 1)[1]
        for (ns, name), obj in list(api.workload.objects.get(("batch", "v1", "jobs"), {}).items()):
            if name.startswith("kmend-validate-") and not obj.get("status", {}).get("succeeded"):
                api.set_status("batch", "v1", "jobs", ns, name, {"succeeded": 1})  # the health check passed


def test_serve_against_a_strict_api_server_heals_an_xid79_end_to_end(tmp_path: Path) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user="system:serviceaccount:kmend-system:kmend")
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        ctl = Controllers(api)
        served = start_serve(tmp_path, "serve", {**TOKENS, **kube_serve_env(tmp_path, api.url, SA_TOKEN),
                                                 "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"})
        url, log = served.url, served.log
        op = {"authorization": "Bearer op-t"}
        try:
            served.wait_ready()
            r = httpx.post(f"{url}/v1/signals", headers={"authorization": "Bearer ingest-t"}, timeout=10, json={
                "signals": [to_wire(container("gpu-1", "step 100 loss 2.1", job="llama", rank=1, pod="llama-worker-1")),
                            to_wire(kernel("gpu-1", XID79))]})
            assert r.status_code == 200, r.text
            # Cordon, taint, label and condition are separate writes: wait for the last of them.
            _until("gpu-1 quarantined", lambda: api.nodes["gpu-1"]["spec"].get("unschedulable")
                   and any(t["key"] == "kmend.io/fault" for t in api.nodes["gpu-1"]["spec"]["taints"])
                   and any(c["type"] == "KmendHealthy" and c["status"] == "False"
                           for c in api.nodes["gpu-1"]["status"]["conditions"])
                   and any(c["type"] == "KmendFault" and c["status"] == "True" and c["reason"] == "GpuLost"
                           for c in api.nodes["gpu-1"]["status"]["conditions"]))
            ev = _until("the quarantine Event", lambda: [e for e in api.events if e["reason"] == "KmendQuarantine"])
            assert ev[0]["metadata"]["namespace"] == "default" and ev[0]["involvedObject"]["name"] == "gpu-1"

            def plan() -> dict[str, Any] | None:
                plans = httpx.get(f"{url}/v1/plans", headers=op, timeout=5).json()["plans"]
                return plans[0] if plans else None

            final = _until("the plan to finish", lambda: (p := plan()) and p["state"] in ("succeeded", "failed")
                           and p, timeout=150, tick=ctl.tick)
        except AssertionError as exc:
            try:
                plans = httpx.get(f"{url}/v1/plans", headers=op, timeout=5).json().get("plans")
            except httpx.HTTPError as why:
                plans = f"unreadable: {why}"
            raise AssertionError(f"{exc}\nplans: {plans}\nlease/requests seen: {api.requests[-20:]}\n"
                                 f"{log.read_text()[-4000:]}") from None
        finally:
            served.stop()
        steps = [(s["kind"], s["state"], s["result"]) for s in final["steps"]]
        assert final["state"] == "succeeded", steps
        forbidden = [line for line in log.read_text().splitlines() if "Forbidden" in line or "(403)" in line]
        assert forbidden == [], forbidden[:5]
        # Every built-in object kmend wrote went out with fieldValidation=Strict (a real server only warns about, and
        # drops, a field it does not know otherwise) and none had a field the v1.36 schema lacks.
        assert api.lax_writes == [] and api.warnings == [], (api.lax_writes[:5], api.warnings[:5])
        # Evicted through the API, recreated by the "operator", bound by kmend's scheduler: off gpu-1, one on a spare.
        bound = {name: p["spec"].get("nodeName") for (ns, name), p in api.pods.items() if ns == NS}
        assert ctl.recreated >= 1 and all(bound.values()) and "gpu-1" not in bound.values(), bound
        assert {"gpu-4", "gpu-5"} & set(bound.values()), bound
        assert any(m == "POST" and p.endswith("/eviction") for m, p in api.requests)
        assert any(m == "POST" and p.endswith("/binding") for m, p in api.requests)
