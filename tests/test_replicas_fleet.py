"""Two real `kmend serve` replicas on one real PostgreSQL behind one address (a round-robin TCP proxy), with a real
`kmend agent` per node (its own CRI and kernel log files) shipping to that address: an Xid 79 on one node and the
job's collective timeouts on the others make one incident rooted on that node and one plan; the leader is killed
with SIGKILL during the plan, the other replica finishes it without a second plan, and every line the agents
shipped, before and after the kill, is stored exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.agent_helpers import CriWriter
from tests.builders import nccl_timeout
from tests.conftest import REPO
from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.procs import Served, kube_serve_env, logs, start_serve, stop_all
from tests.tcp_proxy import RoundRobinProxy
from tests.test_kube_serve_e2e import MANIFEST, NS, SA_TOKEN, TOKENS, Controllers, _until, _world

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

LEASE = ("kmend-system", "kmend-healer")
OP = {"authorization": "Bearer op-t"}
NODES = [f"gpu-{i}" for i in range(4)]
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."


class Node:
    """One simulated node: its pod's CRI log, its kern.log and the real agent that tails them."""

    def __init__(self, tmp: Path, name: str, rank: int) -> None:
        self.name, self.rank = name, rank
        self.root = tmp / name
        self.cri = CriWriter(self.root / "pods", ns=NS, pod=f"llama-worker-{rank}", uid=f"u{rank}")
        self.kern = self.root / "kern.log"
        self.kern.write_text("")
        self.written: list[str] = []
        self.n = 0
        self.log = self.root / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, url: str, token_file: Path) -> None:
        args = ["agent", "--node", self.name, "--service-url", url, "--token-file", str(token_file),
                "--state-dir", str(self.root / "state"), "--pods-root", str(self.root / "pods"),
                "--kernel", "file", "--kern-log", str(self.kern), "--ib-root", str(self.root / "no-ib"),
                "--job", "llama", "--no-prefilter", "--no-nvml", "--no-pod-labels", "--no-node-requests",
                "--no-stacks", "--no-process-exits", "--no-gpu-reset", "--status-port", "0",
                "--poll-interval", "0.1", "--flush-interval", "0.2"]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", *args], cwd=REPO, env=dict(os.environ),
                                         stdout=fh, stderr=subprocess.STDOUT)

    def container(self, msg: str) -> None:
        self.cri.line(msg)
        self.written.append(msg)

    def kernel(self, msg: str) -> None:
        self.n += 1
        with open(self.kern, "a") as fh:
            fh.write(f"2026-11-21T10:00:{self.n % 60:02d}+00:00 {self.name} kernel: [ {51 + self.n}.0] {msg}\n")
        self.written.append(msg)

    def chatter(self, tag: str, lines: int) -> None:
        for i in range(lines):
            self.container(f"step {tag}.{i}: loss 2.{i:03d} lr 3.0e-4 rank {self.rank}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _holder(api: FakeApiServer) -> str:
    lease = api.leases.get(LEASE)
    return str(lease["spec"].get("holderIdentity") or "") if lease else ""


def _get(url: str, path: str) -> Any:
    try:
        return httpx.get(f"{url}{path}", headers=OP, timeout=5).json()
    except httpx.HTTPError:
        return None  # the proxy's connection went to the replica that was just killed: ask again


def _active(url: str) -> list[dict[str, Any]]:
    got = _get(url, "/v1/incidents")
    return [i for i in (got or {}).get("incidents", []) if i["state"] in ("open", "remediating")]


def _plans(url: str) -> list[dict[str, Any]]:
    got = _get(url, "/v1/plans")
    return list(got["plans"]) if got else []


def _stored(db: str) -> Counter[tuple[str, str]]:
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT node, body FROM signals")).all()
    finally:
        engine.dispose()
    out: Counter[tuple[str, str]] = Counter()
    for node, body in rows:
        doc = json.loads(body) if isinstance(body, str) else body
        out[(node, doc["payload"].get("text") or "")] += 1
    return out


def test_agents_behind_one_address_two_replicas_one_plan_nothing_lost(tmp_path: Path, fresh_postgres_url: str) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user="system:serviceaccount:kmend-system:kmend")
    nodes = [Node(tmp_path, name, rank) for rank, name in enumerate(NODES)]
    (tmp_path / "token").write_text(TOKENS["KMEND_INGEST_TOKEN"] + "\n")
    procs: dict[str, Served] = {}
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        ctl = Controllers(api)
        base = {**TOKENS, **kube_serve_env(tmp_path, api.url, SA_TOKEN, drain_grace_s=3),
                "KMEND_DATABASE_URL": fresh_postgres_url, "KMEND_REPLICATED": "true", "KMEND_LEASE_DURATION_S": "4"}
        try:
            for name in ("r1", "r2"):
                procs[name] = start_serve(tmp_path, name, {**base, "KMEND_IDENTITY": name})
            with RoundRobinProxy([("127.0.0.1", p.port) for p in procs.values()]) as proxy:
                url = proxy.url
                for node in nodes:
                    node.chatter("warm-up", 5)
                    node.start(url, tmp_path / "token")
                for served in procs.values():
                    served.wait_ready()
                leader = _until("a replica to hold the Lease", lambda: _holder(api))
                follower = "r2" if leader == "r1" else "r1"

                # gpu-1's GPU falls off the bus; the job's other ranks then time out in their collective.
                nodes[1].kernel(XID)
                _until("the Xid's incident on gpu-1", lambda: [i for i in _active(url)
                                                               if i["root_cause"]["node"] == "gpu-1"])
                for node in nodes:
                    if node.name != "gpu-1":
                        node.container(nccl_timeout(node.rank))
                [inc] = _until("one incident with the Xid and the three timeouts",
                               lambda: (a := _active(url)) and len(a) == 1 and a[0]["finding_count"] == 4 and a)
                assert inc["root_cause"]["node"] == "gpu-1" and inc["fault_class"] == "gpu_lost", inc
                [plan] = _until("the plan", lambda: _plans(url))
                assert plan["incident_id"] == inc["id"] and plan["state"] == "running", plan
                assert all(proxy.connections[("127.0.0.1", p.port)] > 0 for p in procs.values()), proxy.connections

                # The leader dies mid-plan while every agent keeps shipping through the one address.
                for node in nodes:
                    node.chatter("during", 10)
                procs[leader].proc.send_signal(signal.SIGKILL)
                procs[leader].proc.wait(timeout=10)
                for node in nodes:
                    node.chatter("after", 10)
                _until("the follower to take the Lease", lambda: _holder(api) == follower, timeout=60)
                final = _until("the plan to finish", lambda: (p := _plans(url)) and p[0]["state"] in
                               ("succeeded", "failed") and p, timeout=120, tick=ctl.tick)
                assert [p["id"] for p in final] == [plan["id"]] and final[0]["state"] == "succeeded", final
                quarantines = [e for e in api.events if e["reason"] == "KmendQuarantine"]
                assert [e["involvedObject"]["name"] for e in quarantines] == ["gpu-1"], quarantines
                assert [i["id"] for i in _active(url)] in ([], [inc["id"]])

                # Every line every agent shipped is stored exactly once, the kill notwithstanding.
                want = Counter((node.name, line) for node in nodes for line in node.written)
                _until("every shipped line stored", lambda: +(want - _stored(fresh_postgres_url)) == Counter(),
                       timeout=60)
                got = _stored(fresh_postgres_url)
                assert {k: v for k, v in got.items() if v != 1} == {}, "a line stored twice"
                assert set(got) == set(want)
        except AssertionError as exc:
            agents = "\n".join(f"--- {n.name}\n{n.log.read_text(errors='replace')[-1500:]}" for n in nodes
                               if n.log.exists())
            raise AssertionError(f"{exc}\n{logs(procs.values())}\n{agents}") from None
        finally:
            for node in nodes:
                node.stop()
            stop_all(procs.values())
