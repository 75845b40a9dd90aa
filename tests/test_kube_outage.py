"""`kmend serve --cluster kube` when its API server stops, starts, or refuses for good: the loopback server (with the
shipped ClusterRole enforced) goes down for five seconds and comes back on the same port — kmend says so once (not
a warning per loop and round), backs off, and an Xid 79 posted during the outage still ends with the node cordoned
within seconds of the return, by one plan; kmend started into the server's start-up window (403 before RBAC is
loaded, 429 with Retry-After) leads and heals without a traceback; a 403 that lasts is said, and retried, not
silenced or given up on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from tests.builders import XID79, container, kernel
from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.procs import Served, kube_serve_env, lease_holder, start_serve
from tests.test_kube_serve_e2e import MANIFEST, SA_TOKEN, TOKENS, _until, _world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

USER = "system:serviceaccount:kmend-system:kmend"
OUTAGE_S = 5.0


def _serve(tmp_path: Path, api: FakeApiServer) -> Served:
    return start_serve(tmp_path, "serve", {**TOKENS, **kube_serve_env(tmp_path, api.url, SA_TOKEN),
                                           "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"})


def _post_xid79(url: str) -> None:
    r = httpx.post(f"{url}/v1/signals", headers={"authorization": "Bearer ingest-t"}, timeout=10, json={
        "signals": [to_wire(container("gpu-1", "step 100 loss 2.1", job="llama", rank=1, pod="llama-worker-1")),
                    to_wire(kernel("gpu-1", XID79))]})
    assert r.status_code == 200, r.text


def _plans(url: str) -> list[dict[str, Any]]:
    plans: list[dict[str, Any]] = httpx.get(f"{url}/v1/plans", headers={"authorization": "Bearer op-t"},
                                            timeout=5).json()["plans"]
    return plans


def _lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def _cordoned(api: FakeApiServer) -> bool:
    return bool(api.nodes["gpu-1"]["spec"].get("unschedulable"))


def test_an_outage_is_said_once_backed_off_and_healing_goes_on_after_it(tmp_path: Path) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user=USER)
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        served = _serve(tmp_path, api)
        try:
            served.wait_ready()
            _until("kmend to lead", lambda: lease_holder(api) != "")
            _until("the scheduler's pod watch", lambda: any(m == "WATCH" and p == "/api/v1/pods"
                                                            for m, p in api.requests))
            before = len(_lines(served.log))
            api.down()
            _post_xid79(served.url)  # the healer decides while nothing it does can reach the cluster
            time.sleep(OUTAGE_S)  # the outage itself: what kmend logs and asks for during it is the point
            during = _lines(served.log)[before:]
            api.up()
            back = time.monotonic()
            _until("gpu-1 cordoned after the return", lambda: _cordoned(api), timeout=30)
            took = time.monotonic() - back
            _until("the quarantine Event", lambda: [e for e in api.events if e["reason"] == "KmendQuarantine"])
            plans = _plans(served.url)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail(4000)}") from None
        finally:
            served.stop()
        warnings = [line for line in during if " WARNING " in line or " ERROR " in line]
        # One "unreachable" naming the server and the error (and at most a "still unreachable" or two), not one per
        # loop, gang and round (thousands on a five-second outage before).
        assert 1 <= len(warnings) <= 6, warnings[:20]
        assert any(f"API server {api.url} unreachable" in w and "Connection refused" in w for w in warnings), warnings
        log = served.log.read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]
        assert f"API server {api.url} answers again" in log
        assert took <= OUTAGE_S + 3.0, f"cordoned {took:.1f} s after the server came back"
        # One plan, decided once and carried on after the outage; its Event written once.
        assert len(plans) == 1 and plans[0]["node"] == "gpu-1", plans
        assert len([e for e in api.events if e["reason"] == "KmendQuarantine"]) == 1, api.events


def test_serve_started_in_the_api_servers_start_up_window_leads_and_heals(tmp_path: Path) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user=USER)
    with FakeApiServer(rbac=rbac, startup_s=0.1, startup_requests=8) as api:
        _world(api)
        served = _serve(tmp_path, api)
        try:
            served.wait_ready()
            _until("kmend to lead", lambda: lease_holder(api) != "", timeout=30)
            _post_xid79(served.url)
            _until("gpu-1 cordoned", lambda: _cordoned(api), timeout=30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail(4000)}") from None
        finally:
            served.stop()
        codes = {code for code, _, _ in api.startup.answered}
        assert codes == {403, 429}, api.startup.answered  # kmend met both refusals of a starting server
        log = served.log.read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]
        assert served.proc.returncode in (0, -15), served.proc.returncode


def test_a_403_that_lasts_is_said_once_and_retried(tmp_path: Path) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user=USER)
    for rule in rbac.rules:  # the ClusterRole as an operator might trim it: no list or watch of pods
        if "pods" in rule.get("resources", ()) and "" in rule.get("apiGroups", ()):
            rule["verbs"] = [v for v in rule["verbs"] if v not in ("list", "watch")]
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        served = _serve(tmp_path, api)
        try:
            served.wait_ready()
            _until("the scheduler to try its pod list five times",
                   lambda: sum(1 for m, p in api.requests if m == "GET" and p == "/api/v1/pods") >= 5, timeout=60)
        finally:
            served.stop()
        said = [line for line in _lines(served.log) if 'cannot list resource "pods"' in line]
        assert said, served.tail(4000)
        assert all(" WARNING " in line for line in said), said
        assert len(said) <= 2, said  # said, not said on every retry
        assert f'User "{USER}" cannot list resource "pods" in API group "" at the cluster scope' in said[0]

