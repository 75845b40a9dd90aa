"""Leader election on Leases (SimLeases, KubeLeases through the real client on the loopback fake API server, and
on KMEND_TEST_KUBECONFIG's cluster when set): create, renew with the last resourceVersion, 409 = leadership
lost, times written as MicroTime; the executor acts only while leading."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from kubernetes import client

from analyzer.rules import Rule
from healer.kube.lease import KubeLeases
from healer.lease import LeaderElector, LeaseRecord, Leases
from healer.records import PlanState, StepState
from sim.lease import SimLeases
from tests.builders import XID79, kernel
from tests.fake_apiserver import FakeApiServer
from tests.healing import Clock, Harness, incident


@pytest.fixture(params=["sim", "kube-fake", "kube"])
def leases(request: pytest.FixtureRequest) -> Iterator[Leases]:
    if request.param == "sim":
        yield SimLeases()
        return
    if request.param == "kube":
        yield from _real_cluster()
        return
    with FakeApiServer() as api:
        yield KubeLeases(client.ApiClient(client.Configuration(host=api.url)))


def _real_cluster() -> Iterator[Leases]:
    """KubeLeases on KMEND_TEST_KUBECONFIG's cluster, in a namespace of its own that is deleted afterwards."""
    path = os.environ.get("KMEND_TEST_KUBECONFIG")
    if not path:
        pytest.skip("KMEND_TEST_KUBECONFIG is not set: no real cluster to run the contract on")
    from kubernetes import config

    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)  # type: ignore[no-untyped-call]
    api = client.ApiClient(cfg)
    core = client.CoreV1Api(api)
    made = []
    try:
        yield _NamespacedLeases(KubeLeases(api), core, made)
    finally:
        for ns in made:
            core.delete_namespace(ns)


class _NamespacedLeases:
    """Maps each namespace the tests name to a fresh one on the real cluster (created on first use)."""

    def __init__(self, inner: KubeLeases, core: client.CoreV1Api, made: list[str]) -> None:
        self.inner, self.core, self.made = inner, core, made
        self.names: dict[str, str] = {}

    def _ns(self, namespace: str) -> str:
        if namespace not in self.names:
            self.names[namespace] = f"kmend-lease-{uuid.uuid4().hex[:6]}"
            self.core.create_namespace({"metadata": {"name": self.names[namespace]}})
            self.made.append(self.names[namespace])
        return self.names[namespace]

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        got = self.inner.get(self._ns(namespace), name)
        return None if got is None else replace(got, namespace=namespace)

    def create(self, lease: LeaseRecord) -> LeaseRecord:
        return replace(self.inner.create(replace(lease, namespace=self._ns(lease.namespace))),
                       namespace=lease.namespace)

    def update(self, lease: LeaseRecord) -> LeaseRecord:
        return replace(self.inner.update(replace(lease, namespace=self._ns(lease.namespace))),
                       namespace=lease.namespace)


def test_one_leader_renewal_and_takeover_after_expiry(leases: Leases) -> None:
    clock = Clock()
    a = LeaderElector(leases, namespace="kmend-system", name="kmend-healer", identity="a", duration_s=15, clock=clock)
    b = LeaderElector(leases, namespace="kmend-system", name="kmend-healer", identity="b", duration_s=15, clock=clock)
    assert a.tick() and a.is_leader()
    assert not b.tick() and not b.is_leader()
    clock.advance(5)
    assert a.tick()  # renewal with the resourceVersion a last saw
    clock.advance(20)  # a stopped renewing (paused, partitioned): its lease lapses
    assert not a.is_leader()
    assert b.tick() and b.is_leader()
    lease = leases.get("kmend-system", "kmend-healer")
    assert lease is not None and lease.holder == "b" and lease.transitions == 1
    # a comes back and renews with a stale resourceVersion: 409, and it knows it lost.
    assert not a.tick() and not a.is_leader()
    assert b.tick()


def test_released_lease_is_taken_at_once(leases: Leases) -> None:
    clock = Clock()
    a = LeaderElector(leases, namespace="ns", name="l", identity="a", clock=clock)
    b = LeaderElector(leases, namespace="ns", name="l", identity="b", clock=clock)
    assert a.tick()
    a.release()
    assert not a.is_leader() and b.tick()


def test_executor_does_nothing_without_the_lease(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    leading = [False]
    h.executor.is_leader = lambda: leading[0]
    plan = h.plan(incident(shipped_rules, [kernel("gpu-node-03", XID79)]))
    plan = h.executor.execute(plan)
    assert plan.state is PlanState.RUNNING and all(s.state is StepState.PENDING for s in plan.steps)
    assert h.world.applied() == []
    leading[0] = True
    plan = h.executor.execute(plan)
    assert plan.steps[0].state is StepState.SUCCEEDED and h.cluster.get_node("gpu-node-03").unschedulable
