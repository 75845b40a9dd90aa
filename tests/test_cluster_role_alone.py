"""The shipped ClusterRole bound alone (no Role beside it) is all `kmend serve` needs: its leader election included.

A real kube-apiserver (v1.36, checked with the rendered ClusterRole and ClusterRoleBinding only) lets kmend take and
renew its Lease, and nothing more of Leases: another component's Lease, a list of them, stay 403. Here the
loopback API server enforces the same ClusterRole, read from the shipped manifest, through kmend's own adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from healer.cluster import PermanentError
from healer.kube.lease import KubeLeases
from healer.lease import LeaderElector
from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.healing import Clock

MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "service" / "kmend.yaml"
USER = "system:serviceaccount:kmend-system:kmend"


def _cluster_role_only() -> RoleRules:
    docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    [role] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kmend"]
    [binding] = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "kmend"]
    assert binding["roleRef"]["name"] == "kmend"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kmend", "namespace": "kmend-system"}]
    return RoleRules(role["rules"], token="sa", user=USER)  # no Role: what binding the ClusterRole alone grants


def test_the_cluster_role_alone_lets_kmend_lead_and_renew() -> None:
    with FakeApiServer(rbac=_cluster_role_only()) as server:
        api = client.ApiClient(client.Configuration(host=server.url, api_key={"authorization": "Bearer sa"}))
        leases, clock = KubeLeases(api), Clock()
        a = LeaderElector(leases, namespace="kmend-system", name="kmend-healer", identity="a", clock=clock)
        b = LeaderElector(leases, namespace="kmend-system", name="kmend-healer", identity="b", clock=clock)
        assert a.tick() and a.is_leader()  # get (404), create
        clock.advance(5)
        assert a.tick()  # get, update
        assert not b.tick() and not b.is_leader()
        assert server.leases[("kmend-system", "kmend-healer")]["spec"]["holderIdentity"] == "a"


def test_the_cluster_role_grants_no_other_lease() -> None:
    with FakeApiServer(rbac=_cluster_role_only()) as server:
        server.handle("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases", {
            "metadata": {"name": "kube-scheduler"}, "spec": {"holderIdentity": "scheduler-0"}}, "application/json")
        api = client.ApiClient(client.Configuration(host=server.url, api_key={"authorization": "Bearer sa"}))
        with pytest.raises(PermanentError, match="403"):
            KubeLeases(api).get("kube-system", "kube-scheduler")
        thief = LeaderElector(KubeLeases(api), namespace="kube-system", name="kube-scheduler", identity="kmend",
                              clock=Clock())
        assert not thief.tick() and not thief.is_leader()  # the 403 is logged; nothing is written
        assert server.leases[("kube-system", "kube-scheduler")]["spec"]["holderIdentity"] == "scheduler-0"
