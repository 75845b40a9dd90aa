"""Workloads-port contract: SimWorkloads always, KubeWorkloads on the real cluster named by KMEND_TEST_KUBECONFIG.

On a real cluster the test makes its own namespace, Node and pods bound to it (no kubelet: bound pods stay
terminating after deletion, as KUBERNETES-API.md says) and deletes them afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from healer.cluster import TemporaryError
from healer.workloads import ObjectKey, Workloads
from sim.cluster import SimCluster
from sim.workloads import SimWorkloads


@dataclass
class Env:
    """A Workloads adapter with a namespace, a node, and ways to make pods and budgets."""

    workloads: Workloads
    namespace: str
    node: str
    make_pod: Callable[[str, dict[str, str]], None]
    make_budget: Callable[[dict[str, str], int], None]


def _sim() -> Iterator[Env]:
    c = SimCluster()
    c.add_node("contract-node", labels={"nvidia.com/gpu.count": "8"})
    w = SimWorkloads(c, scheduler=False)

    def pod(name: str, labels: dict[str, str]) -> None:
        w.add_pod("contract", name, node="contract-node", gpus=1, labels=labels)

    yield Env(w, "contract", "contract-node", pod, lambda sel, n: w.set_disruption_budget("contract", sel, n))


def _kube() -> Iterator[Env]:
    path = os.environ.get("KMEND_TEST_KUBECONFIG")
    if not path:
        pytest.skip("KMEND_TEST_KUBECONFIG is not set: no real cluster to run the contract on")
    from kubernetes import client, config

    from healer.kube_workloads import KubeWorkloads

    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)
    api = client.ApiClient(cfg)
    core, policy = client.CoreV1Api(api), client.PolicyV1Api(api)
    ns, node = f"kmend-contract-{uuid.uuid4().hex[:6]}", f"kmend-contract-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))

    def pod(name: str, labels: dict[str, str]) -> None:
        core.create_namespaced_pod(ns, {"metadata": {"name": name, "labels": labels}, "spec": {
            "nodeName": node, "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}})

    def budget(selector: dict[str, str], min_available: int) -> None:
        policy.create_namespaced_pod_disruption_budget(ns, {"metadata": {"name": "pdb"}, "spec": {
            "minAvailable": min_available, "selector": {"matchLabels": selector}}})

    try:
        yield Env(KubeWorkloads(api), ns, node, pod, budget)
    finally:
        core.delete_namespace(ns)
        core.delete_node(node)


@pytest.fixture(params=["sim", "kube"])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    yield from (_sim() if request.param == "sim" else _kube())


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
