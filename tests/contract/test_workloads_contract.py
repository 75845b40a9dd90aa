"""Workloads-port contract: SimWorkloads, KubeWorkloads through the real client on a loopback fake API server,
and KubeWorkloads on the real cluster named by KMEND_TEST_KUBECONFIG.

On a real cluster the test makes its own namespace, Node and pods bound to it and marked Running through the
status subresource, as a kubelet would (a Pending pod ignores disruption budgets); with no kubelet, bound pods
stay terminating after deletion, as KUBERNETES-API.md says. It deletes them afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from healer.cluster import NotFoundError, TemporaryError
from healer.jobs import recreatable
from healer.workloads import ObjectKey, OwnerRef, Workloads
from sim.cluster import SimCluster
from sim.workloads import SimWorkloads
from tests.contract.real_cluster import create_namespace
from tests.fake_apiserver import FakeApiServer

PYTORCHJOB = ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet")
COMMAND = ("bus.volcano.sh", "v1alpha1", "commands", "Command")


@dataclass
class Env:
    """A Workloads adapter with a namespace, a node, and ways to make pods and budgets."""

    workloads: Workloads
    namespace: str
    node: str
    make_pod: Callable[[str, dict[str, str]], None]
    make_budget: Callable[[dict[str, str], int], None]
    make_pending_pod: Callable[[str, dict[str, str]], None]
    finish: Callable[[str], None]
    """The kubelet finishes a terminating pod."""
    make_object: Callable[[ObjectKey, dict[str, Any]], None]
    """Create a custom object (its CRD installed) as its owner would."""


def _sim() -> Iterator[Env]:
    c = SimCluster()
    c.add_node("contract-node", labels={"nvidia.com/gpu.count": "8"})
    w = SimWorkloads(c, scheduler=False)

    def pod(name: str, labels: dict[str, str]) -> None:
        w.add_pod("contract", name, node="contract-node", gpus=1, labels=labels)

    def pending(name: str, labels: dict[str, str]) -> None:
        w.add_pod("contract", name, gpus=1, labels=labels)

    yield Env(w, "contract", "contract-node", pod, lambda sel, n: w.set_disruption_budget("contract", sel, n),
              pending, lambda name: w.finish_termination("contract", name), w.add_object)


def _kube_fake() -> Iterator[Env]:
    from kubernetes import client

    from healer.kube.workloads import KubeWorkloads

    with FakeApiServer() as api:
        api.add_node("contract-node")
        api.add_service_account("contract")  # the serviceaccount controller's work on a real cluster
        for kind in (PYTORCHJOB, JOBSET, COMMAND):
            api.install_kind(*kind)
        clients = client.ApiClient(client.Configuration(host=api.url))

        def pod(name: str, labels: dict[str, str]) -> None:
            api.add_pod("contract", name, node="contract-node", labels=labels, phase="Running")

        def budget(selector: dict[str, str], min_available: int) -> None:
            client.PolicyV1Api(clients).create_namespaced_pod_disruption_budget("contract", {
                "metadata": {"name": "pdb"}, "spec": {"minAvailable": min_available,
                                                      "selector": {"matchLabels": selector}}})

        def make_object(key: ObjectKey, manifest: dict[str, Any]) -> None:
            group, _, version = key.api_version.rpartition("/")
            plural = {k[3]: k[2] for k in (PYTORCHJOB, JOBSET, COMMAND)}.get(key.kind, key.kind.lower() + "s")
            api.add_object(group, version, plural, key.namespace,
                           {**manifest, "metadata": {**manifest.get("metadata", {}), "name": key.name}})

        def pending(name: str, labels: dict[str, str]) -> None:
            api.add_pod("contract", name, labels=labels)

        yield Env(KubeWorkloads(clients), "contract", "contract-node", pod, budget, pending,
                  lambda name: api.finish_termination("contract", name), make_object)


def _kube() -> Iterator[Env]:
    path = os.environ.get("KMEND_TEST_KUBECONFIG")
    if not path:
        pytest.skip("KMEND_TEST_KUBECONFIG is not set: no real cluster to run the contract on")
    from kubernetes import client, config

    from healer.kube.workloads import KubeWorkloads

    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)
    api = client.ApiClient(cfg)
    core, policy = client.CoreV1Api(api), client.PolicyV1Api(api)
    ns, node = f"kmend-contract-{uuid.uuid4().hex[:6]}", f"kmend-contract-{uuid.uuid4().hex[:6]}"
    create_namespace(core, ns)
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))

    def pod(name: str, labels: dict[str, str], bound: bool = True) -> None:
        spec: dict[str, Any] = {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
        if bound:
            spec["nodeName"] = node
        core.create_namespaced_pod(ns, {"metadata": {"name": name, "labels": labels}, "spec": spec})
        if bound:  # what the kubelet would report; the API server lets only Running pods be guarded
            core.patch_namespaced_pod_status(name, ns, {"status": {"phase": "Running"}})

    def make_object(key: ObjectKey, manifest: dict[str, Any]) -> None:
        group, _, version = key.api_version.rpartition("/")
        try:
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                group, version, ns, key.kind.lower() + "s",
                {**manifest, "apiVersion": key.api_version, "kind": key.kind,
                 "metadata": {**manifest.get("metadata", {}), "name": key.name}})
        except client.ApiException as exc:
            if exc.status == 404:
                pytest.skip(f"{key.api_version} {key.kind} is not installed on this cluster")
            raise

    def budget(selector: dict[str, str], min_available: int) -> None:
        policy.create_namespaced_pod_disruption_budget(ns, {"metadata": {"name": "pdb"}, "spec": {
            "minAvailable": min_available, "selector": {"matchLabels": selector}}})

    try:
        yield Env(KubeWorkloads(api), ns, node, pod, budget, lambda name, labels: pod(name, labels, bound=False),
                  lambda name: core.delete_namespaced_pod(name, ns, grace_period_seconds=0), make_object)
    finally:
        core.delete_namespace(ns)
        core.delete_node(node)


@pytest.fixture(params=["sim", "kube-fake", "kube"])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    yield from {"sim": _sim, "kube-fake": _kube_fake, "kube": _kube}[request.param]()


def test_eviction_honours_a_disruption_budget_and_never_deletes(env: Env) -> None:
    env.make_pod("guarded-0", {"app": "train"})
    env.make_budget({"app": "train"}, 1)
    with pytest.raises(TemporaryError) as err:
        env.workloads.evict_pod(env.namespace, "guarded-0", 30)
    assert "429" in str(err.value) or "disruption budget" in str(err.value)
    [pod] = env.workloads.list_pods(namespace=env.namespace)
    assert not pod.terminating


def test_evicting_a_bound_pod_leaves_it_terminating(env: Env) -> None:
    env.make_pod("free-0", {"app": "other"})
    env.workloads.evict_pod(env.namespace, "free-0", 30)
    env.workloads.evict_pod(env.namespace, "free-0", 30)  # already terminating: fine
    [pod] = env.workloads.list_pods(namespace=env.namespace, node=env.node)
    assert pod.name == "free-0" and pod.terminating
    env.workloads.evict_pod(env.namespace, "no-such-pod", 30)  # gone: fine
    env.workloads.delete_pod(env.namespace, "no-such-pod")


def test_creates_are_idempotent_and_config_maps_merge(env: Env) -> None:
    manifest = {"metadata": {"name": "made-0", "labels": {"kmend.io/job": "j"}},
                "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}
    env.workloads.create_pod(env.namespace, manifest)
    env.workloads.create_pod(env.namespace, manifest)
    assert [p.name for p in env.workloads.list_pods(namespace=env.namespace, selector={"kmend.io/job": "j"})] == [
        "made-0"]
    env.workloads.apply_config_map(env.namespace, "j-kmend-resume", {"KMEND_RESUME_FROM": "/ck/1"})
    env.workloads.apply_config_map(env.namespace, "j-kmend-resume", {"KMEND_RESUME_STEP": "1"})
    cm = env.workloads.get_object(ObjectKey("v1", "ConfigMap", env.namespace, "j-kmend-resume"))
    assert cm is not None and cm["data"] == {"KMEND_RESUME_FROM": "/ck/1", "KMEND_RESUME_STEP": "1"}
    env.workloads.annotate(ObjectKey("v1", "Pod", env.namespace, "made-0"), {"kmend.io/resume-from": "/ck/1"})
    [pod] = env.workloads.list_pods(namespace=env.namespace, selector={"kmend.io/job": "j"})
    assert pod.annotations["kmend.io/resume-from"] == "/ck/1"
    assert env.workloads.get_object(ObjectKey("v1", "ConfigMap", env.namespace, "nope")) is None


def test_pending_pods_ignore_disruption_budgets(env: Env) -> None:
    env.make_pending_pod("waiting-0", {"app": "train"})
    env.make_budget({"app": "train"}, 1)
    env.workloads.evict_pod(env.namespace, "waiting-0", 30)
    assert env.workloads.list_pods(namespace=env.namespace) == []


def test_a_deleted_pod_stays_terminating_until_the_kubelet_finishes_it(env: Env) -> None:
    env.make_pod("rank-0", {"app": "train"})
    env.workloads.delete_pod(env.namespace, "rank-0", 30)
    [pod] = env.workloads.list_pods(namespace=env.namespace, node=env.node)
    assert pod.terminating and pod.node == env.node
    env.finish("rank-0")
    assert env.workloads.list_pods(namespace=env.namespace) == []


def test_a_pod_recreated_from_its_recorded_manifest_keeps_labels_and_spec(env: Env) -> None:
    env.make_pod("plain-0", {"kmend.io/pod-group": "g", "app": "train"})
    [before] = env.workloads.list_pods(namespace=env.namespace, selector={"kmend.io/pod-group": "g"})
    assert before.phase == "Running" and before.uid and before.created > 0
    manifest = recreatable(before.manifest)
    env.workloads.delete_pod(env.namespace, "plain-0", 30)
    env.finish("plain-0")
    env.workloads.create_pod(env.namespace, manifest)
    [after] = env.workloads.list_pods(namespace=env.namespace, selector={"kmend.io/pod-group": "g"})
    assert after.uid != before.uid and not after.node and after.phase == "Pending"
    assert after.labels == before.labels
    assert after.manifest["spec"]["containers"][0]["name"] == before.manifest["spec"]["containers"][0]["name"]


def test_owner_annotations_are_merged_and_removed(env: Env) -> None:
    key = ObjectKey("kubeflow.org/v1", "PyTorchJob", env.namespace, "llama")
    env.make_object(key, {"metadata": {"annotations": {"team": "nlp"}},
                          "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2}}}})
    env.workloads.annotate(key, {"kmend.io/resume-from": "/ck/7"})
    obj = env.workloads.get_object(key)
    assert obj is not None and obj["metadata"]["annotations"] == {"team": "nlp", "kmend.io/resume-from": "/ck/7"}
    assert obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    env.workloads.annotate(key, {"kmend.io/resume-from": None})
    obj = env.workloads.get_object(key)
    assert obj is not None and obj["metadata"]["annotations"] == {"team": "nlp"}


def test_deleting_an_owner_is_idempotent(env: Env) -> None:
    key = ObjectKey("jobset.x-k8s.io/v1alpha2", "JobSet", env.namespace, "pretrain")
    env.make_object(key, {"spec": {"replicatedJobs": []}})
    env.workloads.delete_object(key)
    env.workloads.delete_object(key)
    assert env.workloads.get_object(key) is None


def test_a_volcano_restart_command_is_created_once_with_its_target(env: Env) -> None:
    key = ObjectKey("bus.volcano.sh/v1alpha1", "Command", env.namespace, "kmend-restart-1")
    target = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": "vc-job", "uid": "u-1"}
    body = {"metadata": {"name": key.name}, "action": "RestartJob", "reason": "kmend", "target": target}
    try:
        env.workloads.create_object(key, body)
    except NotFoundError:
        pytest.skip("bus.volcano.sh/v1alpha1 Command is not installed on this cluster")
    env.workloads.create_object(key, body)
    obj = env.workloads.get_object(key)
    if obj is not None:  # a running Volcano controller consumes the command at once
        assert obj["action"] == "RestartJob" and obj["target"]["name"] == "vc-job"


def test_pods_carry_their_owner(env: Env) -> None:
    env.make_pod("owned-0", {"app": "train"})
    env.workloads.create_pod(env.namespace, {
        "metadata": {"name": "owned-1", "labels": {"app": "train"}, "ownerReferences": [
            {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama", "uid": "u-2",
             "controller": True}]},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}})
    pods = {p.name: p for p in env.workloads.list_pods(namespace=env.namespace, selector={"app": "train"})}
    assert pods["owned-1"].controller == OwnerRef("kubeflow.org/v1", "PyTorchJob", "llama", True)
    assert pods["owned-0"].controller is None


def test_the_jobs_bound_to_a_node_now_are_listed_across_namespaces(env: Env) -> None:
    from healer.jobs import jobs_bound

    env.make_pod("llama-0", {"training.kubeflow.org/job-name": "llama"})
    env.make_pod("old-0", {"training.kubeflow.org/job-name": "old-run"})
    env.make_pending_pod("queued-0", {"training.kubeflow.org/job-name": "queued"})
    assert jobs_bound(env.workloads.list_pods(node=env.node)) == ["llama", "old-run"]
    env.workloads.delete_pod(env.namespace, "old-0", 30)  # terminating: no longer the node's job
    assert jobs_bound(env.workloads.list_pods(node=env.node)) == ["llama"]
    env.finish("old-0")
    assert jobs_bound(env.workloads.list_pods(node="another-node")) == []
