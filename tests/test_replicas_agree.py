"""Two real `kmend serve` replicas on one real PostgreSQL agree wherever a client lands: a node agent's numbered
metric batches alternating between them (a Service without affinity) have a counter's increase and a 4-sample
thermal run found exactly once, on the batch that completes them, and the replica that does not hold the Lease
answers `/v1/nodes` with the incident the leader opened after both started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.procs import Served, kube_serve_env, lease_holder, logs, replica_env, start_replicas, stop_all
from tests.test_kube_serve_e2e import MANIFEST, SA_TOKEN, TOKENS, _until, _world

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

INGEST = {"authorization": "Bearer ingest-t"}
OP = {"authorization": "Bearer op-t"}
NODE = "gpu-5"
GPU = {"gpu": "3", "UUID": "GPU-3f809e614-a528-4083-acbf-334600000000", "pci_bus_id": "00000000:5D:00.0"}



def _batch(seq: int, t: float, remapped: float, throttle: float) -> dict[str, Any]:
    return {"producer": f"{NODE}/agent-1", "seq": seq, "signals": [
        {"id": f"{NODE}/dcgm/{name}/{t}", "node": NODE, "source": "dcgm", "ts": t,
         "payload": {"kind": "metric", "name": name, "value": value, "labels": GPU}}
        for name, value in (("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", remapped),
                            ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", throttle))]}


def test_alternating_metric_batches_and_a_followers_node_view(tmp_path: Path, fresh_postgres_url: str) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user="system:serviceaccount:kmend-system:kmend")
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        base = replica_env({**TOKENS, **kube_serve_env(tmp_path, api.url, SA_TOKEN)}, fresh_postgres_url)
        procs: dict[str, Served] = {}
        try:
            start_replicas(tmp_path, base, procs)
            leader = _until("a replica to hold the Lease", lambda: lease_holder(api))
            follower = procs["r2" if leader == "r1" else "r1"]
            nodes = httpx.get(f"{follower.url}/v1/nodes", headers=OP, timeout=10).json()["nodes"]
            assert nodes[NODE]["state"] == "spare", nodes[NODE]

            # The counter's baseline reaches one replica and its increase the other; the GPU is held down by
            # thermal slowdown on every sample, the fourth of which is the second one the other replica sees.
            t = 1_700_000_000.0
            urls = [procs["r1"].url, procs["r2"].url]
            found = []
            for i, remapped in enumerate([0, 1, 1, 1, 1, 1]):
                r = httpx.post(f"{urls[i % 2]}/v1/signals", headers=INGEST, timeout=30,
                               json=_batch(i + 1, t + 30 * i, remapped, 64))
                assert r.status_code == 200, r.text
                found.append(r.json()["findings"])
            assert found == [0, 1, 0, 1, 0, 0]

            # The leader opens the incidents; the follower, which never folds the feed, shows the node suspect.
            view = _until("the follower to show the node suspect", lambda: (n := httpx.get(
                f"{follower.url}/v1/nodes", headers=OP, timeout=10).json()["nodes"][NODE])["state"] == "suspect"
                and len(n["incidents"]) == 2 and n)
            stored = httpx.get(f"{follower.url}/v1/incidents", headers=OP, timeout=10).json()["incidents"]
            assert sorted(view["incidents"]) == sorted(i["id"] for i in stored if i["root_cause"]["node"] == NODE)
            assert sorted(i["finding_count"] for i in stored) == [1, 1]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs(procs.values())}") from None
        finally:
            stop_all(procs.values())
