"""KubePodScheduling.changes over a real pod watch (official client, loopback fake API server): changes
without relisting, bookmarks, streams that end, 410 Gone answered by exactly one relist, finished pods,
stale cursors and a clean stop of the watch thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from healer.gang.port import PodChanges, PodKey
from healer.gang.records import PodRecord
from healer.kube.pods import KubePodScheduling
from tests.fake_apiserver import FakeApiServer

Held = dict[PodKey, PodRecord]


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node("node-a")
        yield server


@pytest.fixture
def kube(api: FakeApiServer) -> Iterator[KubePodScheduling]:
    port = KubePodScheduling(client.ApiClient(client.Configuration(host=api.url)), clock=time.time,
                             watch_read_timeout_s=1.0)
    yield port
    port.close()


def _pod_lists(api: FakeApiServer) -> int:
    """Pod list requests (watch requests are streamed and not counted here)."""
    return sum(1 for method, path in api.requests if (method, path) == ("GET", "/api/v1/pods"))


class Replica:
    """What a scheduler cache holds: the port's changes applied one after another."""

    def __init__(self, port: KubePodScheduling) -> None:
        self.port = port
        self.cursor = ""
        self.held: Held = {}
        self.reads: list[PodChanges] = []

    def read(self) -> PodChanges:
        got = self.port.changes(self.cursor)
        keys = [(p.namespace, p.name) for p in got.pods]
        assert len(keys) == len(set(keys)), "a pod reported twice in one read"
        self.reads.append(got)
        self.cursor = got.cursor
        if got.full:
            self.held = {}
        for key in got.gone:
            self.held.pop(key, None)
        self.held.update(zip(keys, got.pods, strict=True))
        return got

    def until(self, done: Callable[[Held], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.held):
            assert time.monotonic() < deadline, f"not reached; holding {sorted(self.held)}"
            time.sleep(0.02)
            self.read()


def _names(held: Held) -> set[str]:
    return {name for _, name in held}


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_changes_arrive_from_the_watch_without_listing_again(api: FakeApiServer, kube: KubePodScheduling) -> None:
    api.add_pod("t", "a", scheduler="kmend")
    api.add_pod("t", "b", scheduler="kmend")
    replica = Replica(kube)
    first = replica.read()
    assert first.full and _names(replica.held) == {"a", "b"}
    lists = _pod_lists(api)
    api.add_pod("t", "c", scheduler="kmend")
    kube.bind(replica.held[("t", "a")], "node-a")
    kube.delete_pod(replica.held[("t", "b")])  # unbound: gone at once
    replica.until(lambda h: _names(h) == {"a", "c"} and h[("t", "a")].node_name == "node-a")
    assert not any(r.full for r in replica.reads[1:])
    assert ("t", "b") in {k for r in replica.reads[1:] for k in r.gone}
    assert _pod_lists(api) == lists  # nothing listed pods again
    assert [s.get("allowWatchBookmarks") for s in api.watch.streams] == ["true"]
    assert api.watch.streams[0]["resourceVersion"] != ""
    assert replica.held == {(p.namespace, p.name): p for p in kube.snapshot().pods}


def test_bookmarks_move_the_version_on_while_no_pod_changes(api: FakeApiServer, kube: KubePodScheduling) -> None:
    kube.changes("")
    informer = kube._informer
    assert informer is not None
    listed = int(informer.resource_version)
    api.add_node("node-b")  # moves the server's version; no pod event
    _wait(lambda: int(informer.resource_version) > listed)
    assert int(informer.resource_version) == api.watch.version


def test_a_410_lists_once_and_loses_or_doubles_no_pod(api: FakeApiServer, kube: KubePodScheduling) -> None:
    for name in ("a", "b", "c"):
        api.add_pod("t", name, scheduler="kmend")
    replica = Replica(kube)
    replica.read()
    informer = kube._informer
    assert informer is not None and informer.lists == 1
    lists = _pod_lists(api)
    api.watch.expire()
    # Written while the watch is expiring and the informer lists again: none may be lost.
    api.add_pod("t", "d", scheduler="kmend")
    kube.delete_pod(replica.held[("t", "a")])
    api.set_phase("t", "c", "Succeeded")
    _wait(lambda: informer.lists == 2)
    replica.until(lambda h: _names(h) == {"b", "d"})
    fulls = [r for r in replica.reads[1:] if r.full]
    assert len(fulls) == 1  # the relist is reported once, as a full set
    assert _pod_lists(api) - lists == 1
    api.add_pod("t", "e", scheduler="kmend")
    replica.until(lambda h: "e" in _names(h))
    assert informer.lists == 2 and not replica.reads[-1].full
    assert replica.held == {(p.namespace, p.name): p for p in kube.snapshot().pods}


def test_a_stream_ending_around_an_expiry_loses_nothing_and_lists_at_most_once(
        api: FakeApiServer, kube: KubePodScheduling) -> None:
    api.add_pod("t", "a", scheduler="kmend")
    replica = Replica(kube)
    replica.read()
    informer = kube._informer
    assert informer is not None
    # The client comes back with its version, which is history by then or not, depending on
    # whether the stream delivered "b" before the expiry: either way nothing is lost.
    api.watch.end_streams()
    api.add_pod("t", "b", scheduler="kmend")
    api.watch.expire()
    api.add_pod("t", "c", scheduler="kmend")
    replica.until(lambda h: _names(h) == {"a", "b", "c"})
    time.sleep(0.3)
    assert informer.lists in (1, 2)
    assert sum(r.full for r in replica.reads[1:]) == informer.lists - 1
    assert replica.held == {(p.namespace, p.name): p for p in kube.snapshot().pods}


def test_an_ended_stream_is_watched_again_from_its_version(api: FakeApiServer, kube: KubePodScheduling) -> None:
    replica = Replica(kube)
    replica.read()
    informer = kube._informer
    assert informer is not None
    api.add_pod("t", "a", scheduler="kmend")
    replica.until(lambda h: _names(h) == {"a"})
    version = informer.resource_version
    api.watch.end_streams()
    _wait(lambda: len(api.watch.streams) >= 2)
    api.add_pod("t", "b", scheduler="kmend")
    replica.until(lambda h: _names(h) == {"a", "b"})
    assert int(api.watch.streams[1]["resourceVersion"]) >= int(version)
    assert informer.lists == 1 and not any(r.full for r in replica.reads[1:])


def test_a_cursor_other_than_the_last_gets_a_full_list(api: FakeApiServer, kube: KubePodScheduling) -> None:
    api.add_pod("t", "a", scheduler="kmend")
    first = kube.changes("")
    second = kube.changes(first.cursor)
    assert not second.full
    again = kube.changes(first.cursor)  # a cache that missed ``second``
    assert again.full and [p.name for p in again.pods] == ["a"]
    assert kube.changes("").full


def test_close_stops_the_watch_thread_promptly(api: FakeApiServer, kube: KubePodScheduling) -> None:
    kube.changes("")
    informer = kube._informer
    assert informer is not None and informer.running
    started = time.monotonic()
    kube.close()
    assert not informer.running
    assert time.monotonic() - started < 2.0
    assert kube.changes("").full  # a later read starts over
