"""Binding contract of the PodScheduling port: SimPods and KubePodScheduling through the real client on a
loopback fake API server always, KubePodScheduling on KMEND_TEST_KUBECONFIG's cluster when set."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from healer.cluster import NotFoundError
from healer.gang.port import ConflictError, ObjectRef, PodScheduling
from healer.gang.records import NodeRecord, PodRecord
from sim.pods import SimPods
from tests.contract.real_cluster import create_namespace
from tests.fake_apiserver import FakeApiServer

SCHEDULER = "kmend-contract"
Make = Callable[[str], PodRecord]


def _sim() -> Iterator[tuple[PodScheduling, Make, str]]:
    sim = SimPods(clock=time.time)
    sim.add_node(NodeRecord("node-a", {"cpu": 8000, "pods": 110}))

    def make(name: str) -> PodRecord:
        return sim.add_pod(PodRecord("contract", name, requests={"cpu": 100}, scheduler_name=SCHEDULER))

    yield sim, make, "node-a"


def _kube(path: str) -> Iterator[tuple[PodScheduling, Make, str]]:
    from kubernetes import client, config

    from healer.kube.pods import KubePodScheduling, pod_record

    api: Any = config.new_client_from_config(config_file=path)
    core = client.CoreV1Api(api)
    suffix = uuid.uuid4().hex[:8]
    namespace, node = f"kmend-contract-{suffix}", f"kmend-contract-{suffix}"
    create_namespace(core, namespace)
    core.create_node({"metadata": {"name": node}})

    def make(name: str) -> PodRecord:
        core.create_namespaced_pod(namespace, {
            "metadata": {"name": name},
            "spec": {"schedulerName": SCHEDULER, "containers": [{"name": "c", "image": "busybox"}]}})
        raw = core.read_namespaced_pod(name, namespace, _preload_content=False)
        return pod_record(json.loads(raw.data))

    port = KubePodScheduling(api, clock=time.time)
    try:
        yield port, make, node
    finally:
        port.close()
        for pod in core.list_namespaced_pod(namespace).items:  # a bare server runs no namespace controller
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        core.delete_namespace(namespace)
        core.delete_node(node)


def _kube_fake() -> Iterator[tuple[PodScheduling, Make, str]]:
    from kubernetes import client

    from healer.kube.pods import KubePodScheduling, pod_record

    with FakeApiServer() as api:
        api.add_node("node-a")
        api.install_crd("scheduling.x-k8s.io", "v1alpha1")

        def make(name: str) -> PodRecord:
            return pod_record(api.add_pod("contract", name, scheduler=SCHEDULER, requests={"cpu": "100m"}))

        # A page size of 2 makes every list in the contract span several pages.
        port = KubePodScheduling(client.ApiClient(client.Configuration(host=api.url)), clock=time.time,
                                 page_size=2, watch_read_timeout_s=1.0)
        try:
            yield port, make, "node-a"
        finally:
            port.close()


PORTS = ["sim", "kube-fake", "kube"]


@pytest.fixture(params=PORTS)
def port(request: pytest.FixtureRequest) -> Iterator[tuple[PodScheduling, Make, str]]:
    if request.param == "sim":
        yield from _sim()
        return
    if request.param == "kube-fake":
        yield from _kube_fake()
        return
    path = os.environ.get("KMEND_TEST_KUBECONFIG")
    if not path:
        pytest.skip("KMEND_TEST_KUBECONFIG is not set: no real API server to run the contract against")
    yield from _kube(path)


def _find(p: PodScheduling, pod: PodRecord) -> PodRecord | None:
    return next((x for x in p.snapshot().pods if (x.namespace, x.name) == (pod.namespace, pod.name)), None)


def test_bind_places_a_pending_pod(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    pod = make("bind-ok")
    assert any(x.name == "bind-ok" for x in p.list_pending(SCHEDULER))
    p.bind(pod, node)
    bound = _find(p, pod)
    assert bound is not None and bound.node_name == node
    assert not any(x.name == "bind-ok" for x in p.list_pending(SCHEDULER))


def test_binding_a_bound_pod_is_a_conflict(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    pod = make("bind-twice")
    p.bind(pod, node)
    with pytest.raises(ConflictError):
        p.bind(pod, node)


def test_binding_with_a_stale_uid_is_a_conflict(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    pod = make("bind-stale")
    with pytest.raises(ConflictError):
        p.bind(dataclasses.replace(pod, uid=str(uuid.uuid4())), node)


def test_binding_a_missing_pod_is_not_found(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    pod = make("bind-gone")
    p.delete_pod(pod)
    with pytest.raises(NotFoundError):
        p.bind(pod, node)


def test_deleting_a_bound_pod_leaves_it_terminating(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    pod = make("delete-bound")
    p.bind(pod, node)
    p.delete_pod(pod)
    seen = _find(p, pod)
    assert seen is not None and seen.terminating and seen.node_name == node
    with pytest.raises(ConflictError):
        p.bind(dataclasses.replace(pod, uid=seen.uid), node)
    p.delete_pod(pod)  # idempotent


def test_deleting_an_unbound_pod_removes_it(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, _ = port
    pod = make("delete-pending")
    p.delete_pod(pod)
    assert _find(p, pod) is None
    p.delete_pod(pod)  # a missing pod is not an error


def test_events_are_accepted(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, _ = port
    pod = make("event-target")
    ref = ObjectRef("Pod", pod.namespace, pod.name, pod.uid)
    p.emit_event(ref, "FailedScheduling", "needs 1 pod", "Warning")


def test_pending_lists_only_unbound_pods_of_the_scheduler(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    pods = [make(f"page-{i}") for i in range(5)]
    p.bind(pods[0], node)
    assert sorted(x.name for x in p.list_pending(SCHEDULER) if x.name.startswith("page-")) == [
        f"page-{i}" for i in range(1, 5)]
    assert sum(1 for x in p.snapshot().pods if x.name.startswith("page-")) == 5


def test_changes_replayed_give_the_snapshot(port: tuple[PodScheduling, Make, str]) -> None:
    p, make, node = port
    first = make("chg-a")
    seen = p.changes("")
    assert seen.full
    held = {(x.namespace, x.name): x for x in seen.pods}
    second = make("chg-b")
    p.bind(first, node)
    p.delete_pod(second)
    cursor = seen.cursor
    # A watching adapter reports a write once its stream delivers it, so read until it has.
    deadline = time.monotonic() + 10
    while True:
        later = p.changes(cursor)
        cursor = later.cursor
        if later.full:
            held = {}
        for key in later.gone:
            held.pop(key, None)
        held.update({(x.namespace, x.name): x for x in later.pods})
        want = {(x.namespace, x.name): x for x in p.snapshot().pods}
        if held == want or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert held == want
    assert held[(first.namespace, first.name)].node_name == node
