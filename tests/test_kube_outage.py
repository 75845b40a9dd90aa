"""`kmend serve --cluster kube` when its API server stops or starts: the loopback server (with the
shipped ClusterRole enforced) goes down for five seconds and comes back on the same port — kmend says so once (not
a warning per loop and round), backs off, and an Xid 79 posted during the outage still ends with the node cordoned
within seconds of the return, by one plan; kmend started into the server's start-up window (403 before RBAC is
loaded, 429 with Retry-After) leads and heals without a traceback; a plan that was under way when the server
stopped finishes after it, each step done once."""

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
from tests.test_kube_serve_e2e import MANIFEST, SA_TOKEN, TOKENS, Controllers, _until, _world

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
        # The error as the client met it: refused, or reset (a connection the stopping server had accepted).
        assert any(f"API server {api.url} unreachable" in w and ("Connection refused" in w or "Connection reset" in w)
                   for w in warnings), warnings
        log = served.log.read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]
        assert f"API server {api.url} answers again" in log
        # The loops wait at most 5 s between tries, and the first answer wakes the healer: seconds, even loaded.
        assert took <= 10.0, f"cordoned {took:.1f} s after the server came back"
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


def test_a_plan_started_before_an_outage_finishes_after_it_each_step_once(tmp_path: Path) -> None:
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token=SA_TOKEN, user=USER)
    with FakeApiServer(rbac=rbac) as api:
        _world(api)
        ctl = Controllers(api)
        served = _serve(tmp_path, api)
        try:
            served.wait_ready()
            _until("kmend to lead", lambda: lease_holder(api) != "")
            _post_xid79(served.url)
            _until("gpu-1 cordoned", lambda: _cordoned(api))
            api.down()  # the plan's taint, label, condition, Event, drain and the rest are still to come
            time.sleep(3.0)
            api.up()
            final = _until("the plan to finish", lambda: (p := _plans(served.url)) and p[0]["state"] in (
                "succeeded", "failed") and p, timeout=150, tick=ctl.tick)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail(4000)}") from None
        finally:
            served.stop()
        assert len(final) == 1, final
        steps = [(s["kind"], s["state"], s["result"]) for s in final[0]["steps"]]
        assert final[0]["state"] == "succeeded", steps
        assert len([e for e in api.events if e["reason"] == "KmendQuarantine"]) == 1, api.events
        evicted = [p for m, p, _ in api.bodies if m == "POST" and p.endswith("/llama-worker-1/eviction")]
        assert len(evicted) == 1, evicted
        assert "Traceback" not in served.log.read_text(errors="replace"), served.tail(4000)
