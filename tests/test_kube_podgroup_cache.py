"""PodGroups read from watch-fed caches (official client, loopback fake API server): the gang scheduler's cycles
list each PodGroup API once, not once per cycle; PodGroups added, changed and deleted arrive through the watch; an
expired watch (410 Gone) is answered by one list; a PodGroup CRD that is not installed reads as no PodGroups."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from healer.gang.port import PodGroupPhase, PodGroupStatus
from healer.gang.records import PodGroupKind
from healer.kube.pods import KubePodScheduling
from tests.fake_apiserver import FakeApiServer

COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1")
VOLCANO = ("scheduling.volcano.sh", "v1beta1")


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node("gpu-0")
        server.install_crd(*COSCHEDULING)  # Volcano's CRD is not installed: its lists and watches answer 404
        server.add_custom(*COSCHEDULING, "team-a", "train", {"minMember": 4})
        yield server


def _group_lists(api: FakeApiServer) -> dict[str, int]:
    """PodGroup list requests per API group (watches are streamed and counted apart)."""
    counts = {COSCHEDULING[0]: 0, VOLCANO[0]: 0}
    for method, path in api.requests:
        for group, version in (COSCHEDULING, VOLCANO):
            if (method, path) == ("GET", f"/apis/{group}/{version}/podgroups"):
                counts[group] += 1
    return counts


def _until(what: str, pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_gang_schedulers_cycles_list_podgroups_once_and_follow_them_through_the_watch(
        api: FakeApiServer) -> None:
    port = KubePodScheduling(client.ApiClient(client.Configuration(host=api.url)), clock=time.time,
                             watch_read_timeout_s=1.0)
    cursor = ""

    def groups() -> dict[str, int]:
        nonlocal cursor
        got = port.changes(cursor)
        cursor = got.cursor
        return {f"{g.namespace}/{g.name}": g.min_member for g in got.pod_groups}

    try:
        for _ in range(40):  # forty scheduling cycles
            assert groups() == {"team-a/train": 4}
        assert _group_lists(api) == {COSCHEDULING[0]: 1, VOLCANO[0]: 1}
        # The watch follows the list on the informer's own thread: wait for it rather than read once.
        _until("the PodGroup watch", lambda: (
            "WATCH", f"/apis/{COSCHEDULING[0]}/{COSCHEDULING[1]}/podgroups") in api.requests)

        api.add_custom(*COSCHEDULING, "team-b", "eval", {"minMember": 2})
        _until("the new PodGroup seen", lambda: groups() == {"team-a/train": 4, "team-b/eval": 2})
        # kmend's own status write comes back through the watch, with the annotation it set.
        port.set_pod_group_status("team-b", "eval", PodGroupKind.COSCHEDULING,
                                  PodGroupStatus(PodGroupPhase.SCHEDULED, 2, "all members bound"))
        _until("the status write seen", lambda: any(
            g.name == "eval" and g.annotations.get("kmend.io/scheduled-members") == "2"
            for g in port.changes(cursor).pod_groups))
        api.remove_custom(*COSCHEDULING, "team-a", "train")
        _until("the deletion seen", lambda: groups() == {"team-b/eval": 2})
        assert _group_lists(api)[COSCHEDULING[0]] == 1

        # etcd compacted the history: one list, and the view is current again.
        api.podgroup_watch[COSCHEDULING].expire()
        api.add_custom(*COSCHEDULING, "team-c", "sweep", {"minMember": 8})
        _until("the PodGroup made after the expiry seen", lambda: "team-c/sweep" in groups())
        # The stream may hand over the new group before its 410 (both were pending when it woke): the list follows.
        _until("the list after the expiry", lambda: _group_lists(api)[COSCHEDULING[0]] == 2)
        time.sleep(0.3)
        assert _group_lists(api)[COSCHEDULING[0]] == 2
        assert "team-c/sweep" in groups()
    finally:
        port.close()


@pytest.mark.parametrize("watch", [False, True])
def test_an_uninstalled_podgroup_crd_answers_a_plain_404(api: FakeApiServer, watch: bool) -> None:
    """As kube-apiserver v1.24 answers (checked by hand): its router knows no such group, so the 404 is plain
    text, not a Status, for a list and a watch alike."""
    custom = client.CustomObjectsApi(client.ApiClient(client.Configuration(host=api.url)))
    with pytest.raises(client.ApiException) as refused:
        custom.list_cluster_custom_object(*VOLCANO, "podgroups", watch=watch, _preload_content=False)
    assert (refused.value.status, refused.value.body) == (404, "404 page not found\n")
