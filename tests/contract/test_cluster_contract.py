"""Cluster-port contract: SimCluster, KubeCluster on a loopback fake API server, and KubeCluster on the
real cluster named by KMEND_TEST_KUBECONFIG.

On a real cluster the test creates its own Node objects (no kubelet needed: the API
server stores them) and deletes them afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from healer.cluster import Cluster, ClusterEvent, Condition, NotFoundError, Taint
from sim.cluster import SimCluster
from tests.fake_apiserver import FakeApiServer

NodeFactory = Callable[[], str]


def _sim() -> Iterator[tuple[Cluster, NodeFactory]]:
    c = SimCluster()

    def make() -> str:
        name = f"contract-{uuid.uuid4().hex[:8]}"
        c.add_node(name, labels={"kmend.io/test": "true"})
        return name

    yield c, make


def _kube() -> Iterator[tuple[Cluster, NodeFactory]]:
    path = os.environ.get("KMEND_TEST_KUBECONFIG")
    if not path:
        pytest.skip("KMEND_TEST_KUBECONFIG is not set: no real cluster to run the contract on")
    from kubernetes import client, config

    from healer.kube.cluster import KubeCluster

    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)
    api = client.ApiClient(cfg)
    core = client.CoreV1Api(api)
    made: list[str] = []

    def make() -> str:
        name = f"kmend-contract-{uuid.uuid4().hex[:8]}"
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels={"kmend.io/test": "true"})))
        made.append(name)
        # Like a kubelet would: Ready, so the not-ready taint goes away on real clusters with a controller.
        KubeCluster(api).set_condition(name, Condition("Ready", "True", "KubeletReady", "contract test"))
        return name

    try:
        yield KubeCluster(api), make
    finally:
        for name in made:
            core.delete_node(name)


def _kube_fake() -> Iterator[tuple[Cluster, NodeFactory]]:
    from kubernetes import client

    from healer.kube.cluster import KubeCluster

    with FakeApiServer() as api:
        def make() -> str:
            name = f"contract-{uuid.uuid4().hex[:8]}"
            api.add_node(name, labels={"kmend.io/test": "true"})
            return name

        yield KubeCluster(client.ApiClient(client.Configuration(host=api.url))), make


@pytest.fixture(params=["sim", "kube-fake", "kube"])
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, NodeFactory]]:
    yield from {"sim": _sim, "kube-fake": _kube_fake, "kube": _kube}[request.param]()


def test_cordon_and_uncordon_are_idempotent(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, make = cluster
    n = make()
    assert not c.get_node(n).unschedulable
    c.cordon(n)
    c.cordon(n)
    assert c.get_node(n).unschedulable
    c.uncordon(n)
    c.uncordon(n)
    assert not c.get_node(n).unschedulable


def test_taint_is_added_once_and_leaves_other_taints_alone(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, make = cluster
    n = make()
    c.add_taint(n, Taint("example.com/other", "x", "NoSchedule"))
    c.add_taint(n, Taint("kmend.io/fault", "gpu_lost", "NoSchedule"))
    c.add_taint(n, Taint("kmend.io/fault", "gpu_lost", "NoSchedule"))
    taints = [t for t in c.get_node(n).taints if t.key in ("kmend.io/fault", "example.com/other")]
    assert sorted((t.key, t.value, t.effect) for t in taints) == [
        ("example.com/other", "x", "NoSchedule"), ("kmend.io/fault", "gpu_lost", "NoSchedule")]
    c.add_taint(n, Taint("kmend.io/fault", "nvlink", "NoSchedule"))  # same key+effect: replaced
    faults = [t.value for t in c.get_node(n).taints if t.key == "kmend.io/fault"]
    assert faults == ["nvlink"]
    c.remove_taint(n, "kmend.io/fault")
    c.remove_taint(n, "kmend.io/fault")
    keys = {t.key for t in c.get_node(n).taints}
    assert "kmend.io/fault" not in keys and "example.com/other" in keys


def test_condition_written_through_status_replaces_only_its_type(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, make = cluster
    n = make()
    c.set_condition(n, Condition("KmendHealthy", "False", "GpuLost", "Xid 79 on GPU 3"))
    c.set_condition(n, Condition("KmendHealthy", "False", "GpuLost", "Xid 79 on GPU 3"))
    conds = {x.type: x for x in c.get_node(n).conditions}
    assert conds["KmendHealthy"].status == "False" and conds["KmendHealthy"].reason == "GpuLost"
    assert conds["Ready"].status == "True"


def test_events_are_recorded_for_existing_nodes(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, make = cluster
    n = make()
    c.emit_event(ClusterEvent(n, "KmendQuarantine", "incident inc-1: gpu_lost"))
    with pytest.raises(NotFoundError):
        c.emit_event(ClusterEvent("no-such-node-kmend", "KmendQuarantine", "x"))


def test_missing_node_is_not_found(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, _ = cluster
    for op in (lambda: c.get_node("no-such-node-kmend"), lambda: c.cordon("no-such-node-kmend"),
               lambda: c.add_taint("no-such-node-kmend", Taint("k", "v", "NoSchedule"))):
        with pytest.raises(NotFoundError):
            op()


def test_new_node_is_not_ready_tainted_until_ready() -> None:
    """KUBERNETES-API.md: a fresh node carries node.kubernetes.io/not-ready:NoSchedule (sim only)."""
    c = SimCluster()
    c.add_node("fresh", ready=False)
    assert any(t.key == "node.kubernetes.io/not-ready" for t in c.get_node("fresh").taints)
    c.set_condition("fresh", Condition("Ready", "True", "KubeletReady", "ok"))
    assert not any(t.key == "node.kubernetes.io/not-ready" for t in c.get_node("fresh").taints)


def test_node_metadata_patch_touches_only_named_keys(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, make = cluster
    n = make()
    c.patch_node_metadata(n, labels={"kmend.io/quarantined": "true"},
                          annotations={"kmend.io/quarantined-by": "kmend", "kmend.io/plan": "plan-1"})
    c.patch_node_metadata(n, labels={"kmend.io/quarantined": "true"})  # again: no change
    info = c.get_node(n)
    assert info.labels["kmend.io/quarantined"] == "true" and info.labels["kmend.io/test"] == "true"
    assert info.annotations["kmend.io/quarantined-by"] == "kmend"
    c.patch_node_metadata(n, labels={"kmend.io/quarantined": None}, annotations={"kmend.io/plan": None})
    info = c.get_node(n)
    assert "kmend.io/quarantined" not in info.labels and "kmend.io/plan" not in info.annotations
    assert info.annotations["kmend.io/quarantined-by"] == "kmend"


def test_keyed_event_is_recorded_once(cluster: tuple[Cluster, NodeFactory]) -> None:
    c, make = cluster
    n = make()
    c.emit_event(ClusterEvent(n, "KmendQuarantine", "incident inc-2", key=f"plan-{n}-4"))
    c.emit_event(ClusterEvent(n, "KmendQuarantine", "incident inc-2", key=f"plan-{n}-4"))
    if isinstance(c, SimCluster):
        assert len([e for e in c.events if e.key == f"plan-{n}-4"]) == 1
