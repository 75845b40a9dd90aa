"""Two real `kmend serve` processes on one real PostgreSQL and one loopback API server (shipped RBAC, one Lease):
an Xid 79 posted to one replica and the job's collective timeouts to the other make one incident rooted on the
GPU's node and one plan; the leader is killed with the plan under way, the other replica takes the Lease, finishes
the plan without making another or quarantining twice, and recognises a replay of a numbered batch the dead
replica had taken."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from tests.builders import XID79, container, kernel, nccl_timeout
from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.procs import Served, kube_serve_env, lease_holder, logs, replica_env, start_replicas, stop_all
from tests.test_kube_serve_e2e import MANIFEST, NS, SA_TOKEN, TOKENS, Controllers, _until, _world

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(420)]

INGEST = {"authorization": "Bearer ingest-t"}
OP = {"authorization": "Bearer op-t"}



def _plans(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/v1/plans", headers=OP, timeout=5).json()["plans"])


def test_two_replicas_one_incident_one_plan_and_a_takeover(tmp_path: Path, fresh_postgres_url: str) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user="system:serviceaccount:kmend-system:kmend")
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        ctl = Controllers(api)
        base = replica_env({**TOKENS, **kube_serve_env(tmp_path, api.url, SA_TOKEN)}, fresh_postgres_url)
        procs: dict[str, Served] = {}
        try:
            start_replicas(tmp_path, base, procs)
            leader = _until("a replica to hold the Lease", lambda: lease_holder(api))
            follower = "r2" if leader == "r1" else "r1"
            lurl, furl = procs[leader].url, procs[follower].url

            # The GPU's Xid reaches the follower; the job's ranks time out in their collective at the leader.
            xid_batch = {"signals": [to_wire(kernel("gpu-1", XID79))], "producer": "gpu-1/agent-1", "seq": 1}
            r = httpx.post(f"{furl}/v1/signals", headers=INGEST, timeout=10, json=xid_batch)
            assert r.status_code == 200 and r.json()["findings"] == 1 and r.json()["incidents"] == [], r.text
            symptoms = [to_wire(container(f"gpu-{rank}", nccl_timeout(rank), job="llama", rank=rank,
                                          pod=f"llama-worker-{rank}")) for rank in range(4)]
            r = httpx.post(f"{lurl}/v1/signals", headers=INGEST, timeout=10,
                           json={"signals": symptoms, "producer": "fleet/agents", "seq": 1})
            assert r.status_code == 200, r.text

            # One incident, rooted on gpu-1, holding all five findings; one plan, quarantining gpu-1.
            def active() -> list[dict[str, Any]]:
                got = httpx.get(f"{furl}/v1/incidents", headers=OP, timeout=5).json()["incidents"]
                return [i for i in got if i["state"] in ("open", "remediating")]

            [inc] = _until("one incident with all five findings",
                           lambda: (a := active()) and a[0]["finding_count"] == 5 and a)
            assert inc["root_cause"]["node"] == "gpu-1" and inc["fault_class"] == "gpu_lost", inc
            _until("gpu-1 quarantined", lambda: [e for e in api.events if e["reason"] == "KmendQuarantine"])
            [plan] = _until("the plan", lambda: _plans(furl))
            assert plan["incident_id"] == inc["id"] and plan["state"] == "running", plan

            # The leader dies with the drain under way (no kubelet has finished the evicted pods yet).
            killed_at = time.monotonic()
            procs[leader].proc.send_signal(signal.SIGKILL)
            procs[leader].proc.wait(timeout=10)
            _until("the follower to take the Lease", lambda: lease_holder(api) == follower, timeout=60)
            takeover_s = time.monotonic() - killed_at
            print(f"takeover: the Lease moved {takeover_s:.1f} s after the leader was killed (duration 4 s)")
            final = _until("the plan to finish", lambda: (p := _plans(furl)) and p[0]["state"] in
                           ("succeeded", "failed") and p, timeout=150, tick=ctl.tick)
            assert [p["id"] for p in final] == [plan["id"]] and final[0]["state"] == "succeeded", final
            quarantines = [e for e in api.events if e["reason"] == "KmendQuarantine"
                           and e["involvedObject"]["name"] == "gpu-1"]
            assert len(quarantines) == 1, quarantines
            assert takeover_s < 4 + 30, takeover_s  # the Lease lapses after 4 s; a loaded machine adds the rest

            # The dead replica took batch 1 of gpu-1's agent; the agent sends it again to the survivor.
            r = httpx.post(f"{furl}/v1/signals", headers=INGEST, timeout=10, json=xid_batch)
            assert r.json() == {"accepted": 0, "duplicates": 1, "findings": 0, "incidents": []}, r.text
            [again] = active() or [inc]
            assert again["id"] == inc["id"] and again["finding_count"] == 5
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs(procs.values())}") from None
        finally:
            stop_all(procs.values())
        assert {name for (ns, name) in api.pods if ns == NS} >= {f"llama-worker-{r}" for r in range(4)}
