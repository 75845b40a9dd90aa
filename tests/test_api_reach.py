"""Backing off from an API server that does not answer: the shared backoff (growing, jittered, capped, never shorter
than a Retry-After), the one-warning-per-outage log, a list/watch cache against the loopback server stopped and
started again (quiet, backed off, in sync again after the return; a 429's Retry-After waited for), and the gang
scheduler refused by RBAC for good (said once, retried)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from healer.gang.scheduler import GangScheduler
from healer.kube.cache import ListWatchCache
from healer.kube.pods import KubePodScheduling
from healer.kube.rest import NODES, Rest
from healer.reach import Backoff, Reachability
from tests.fake_apiserver import FakeApiServer, RoleRules
from tests.test_kube_serve_e2e import MANIFEST


def _until(what: str, pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_backoff_grows_is_capped_honours_retry_after_and_resets() -> None:
    b = Backoff(first_s=0.1, cap_s=5.0, rng=random.Random(7))
    waits = [b.next() for _ in range(12)]
    assert 0.05 <= waits[0] <= 0.1 and all(w <= 5.0 for w in waits)
    assert waits[6] > waits[0] * 8 and min(waits[8:]) >= 2.5  # grown to the cap's half-to-whole band
    assert b.next(at_least=3.0) >= 3.0 and b.next(at_least=60.0) == 5.0  # the cap bounds even what is asked
    b.reset()
    assert b.next() <= 0.1


def test_an_outage_is_warned_once_then_at_doubling_intervals_and_its_end_told_once(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    returned: list[int] = []
    reach = Reachability("https://api:6443", clock=lambda: now[0], still_first_s=5.0)
    reach.on_return.append(lambda: returned.append(1))
    caplog.set_level(logging.INFO, logger="healer.reach")
    for _ in range(400):  # 40 s of calls every 0.1 s from every loop
        reach.failed(ConnectionRefusedError("[Errno 111] Connection refused"))
        now[0] += 0.1
    reach.answered()
    reach.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "API server https://api:6443 unreachable: [Errno 111] Connection refused"
    still = [m for m in lines if "still unreachable" in m]
    assert [m.split(" after ")[1].split(" s")[0] for m in still] == ["5", "15", "35"]  # 5, then 10, then 20 s apart
    assert lines[-1].startswith("API server https://api:6443 answers again after 40.0 s")
    assert len(lines) == 5 and returned == [1] and not reach.down and reach.outages == 1


def test_a_cache_backs_off_quietly_while_the_server_is_down_and_syncs_after_it(
        caplog: pytest.LogCaptureFixture) -> None:
    with FakeApiServer() as api:
        api.add_node("gpu-1")
        cfg = client.Configuration(host=api.url)
        cfg.retries = False
        rest = Rest(client.ApiClient(cfg))
        calls: list[float] = []
        lister = rest.lister(NODES)

        def counted(*args: Any, **kw: Any) -> Any:
            calls.append(time.monotonic())
            return lister(*args, **kw)

        cache: ListWatchCache[str] = ListWatchCache("node", counted, lambda o: o["metadata"]["name"], retry_s=0.05,
                                                    read_timeout_s=1.0, timeout_s=2.0)
        caplog.set_level(logging.WARNING)
        cache.start()
        try:
            _until("the watch", lambda: cache.synced)
            api.down()
            down_at, before = time.monotonic(), len(calls)
            time.sleep(3.0)  # the outage: how often the cache asks during it is the point
            tries = len([t for t in calls[before:] if t >= down_at])
            api.up()
            api.add_node("gpu-2")
            _until("the cache to see a node added after the return", lambda: "gpu-2" in cache.items(), timeout=15)
        finally:
            cache.stop()
        # 0.05 s apart for 3 s would be 60 tries; doubling waits make it about six.
        assert 1 <= tries <= 10, tries
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        said = [m for m in warned if "unreachable" in m]
        assert len(said) == 1 and said[0].startswith(f"API server {api.url} unreachable: "), warned
        assert not [m for m in warned if "watch failed" in m], warned
        assert rest.reach.outages == 1 and not rest.reach.down


def test_a_cache_waits_as_long_as_a_429_asks() -> None:
    with FakeApiServer() as api:
        api.add_node("gpu-1")
        rest = Rest(client.ApiClient(client.Configuration(host=api.url)))
        calls: list[tuple[float, bool]] = []
        lister = rest.lister(NODES)

        def counted(*args: Any, **kw: Any) -> Any:
            calls.append((time.monotonic(), bool(kw.get("watch"))))
            return lister(*args, **kw)

        cache: ListWatchCache[str] = ListWatchCache("node", counted, lambda o: o["metadata"]["name"], retry_s=0.05,
                                                    read_timeout_s=1.0, timeout_s=2.0, watch_timeout_s=1)
        cache.start()
        try:
            _until("the watch", lambda: cache.synced)
            api.startup = api.startup.again()
            api.startup.at_least = 1  # the next request is answered 429 with Retry-After: 1
            api.node_watch.end_streams()  # the watch is asked again, and throttled
            _until("the throttled watch", lambda: bool(api.startup.answered))
            at = time.monotonic()
            _until("the watch asked again", lambda: any(t > at for t, watching in calls if watching), timeout=10)
            again = min(t for t, watching in calls if watching and t > at)
        finally:
            cache.stop()
        assert again - at >= 0.9, again - at  # Retry-After: 1, not the 0.05 s retry


def test_a_403_that_lasts_is_said_once_by_the_scheduler_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    """The shipped ClusterRole trimmed of pods' list and watch: the gang scheduler's cycle is refused each time; the
    403 naming the verb, resource and scope is logged once, and the cycle is tried again (backing off), not
    abandoned."""
    user = "system:serviceaccount:kmend-system:kmend"
    rbac = RoleRules.from_manifest(MANIFEST, "kmend", token="t", user=user)
    for rule in rbac.rules:
        if "pods" in rule.get("resources", ()) and "" in rule.get("apiGroups", ()):
            rule["verbs"] = [v for v in rule["verbs"] if v not in ("list", "watch")]
    with FakeApiServer(rbac=rbac) as api:
        cfg = client.Configuration(host=api.url)
        cfg.api_key = {"authorization": "Bearer t"}
        scheduler = GangScheduler(port=KubePodScheduling(client.ApiClient(cfg), clock=time.time),
                                  is_leader=lambda: True, clock=time.time)
        stop = threading.Event()
        caplog.set_level(logging.WARNING)
        thread = threading.Thread(target=scheduler.run, args=(stop, 0.05), daemon=True)
        thread.start()
        try:
            _until("five refused pod lists",
                   lambda: sum(1 for m, p in api.requests if m == "GET" and p == "/api/v1/pods") >= 5)
        finally:
            stop.set()
            scheduler.wake()
            thread.join(10)
    said = [r.getMessage() for r in caplog.records if 'cannot list resource "pods"' in r.getMessage()]
    assert len(said) == 1, said
    assert f'User "{user}" cannot list resource "pods" in API group "" at the cluster scope' in said[0]
