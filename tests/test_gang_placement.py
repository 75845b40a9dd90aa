"""Gang placement core: all-or-nothing, filters, topology minimality, spares, reservations, order, reasons."""

from __future__ import annotations

from collections import Counter

import pytest

from healer.gang.config import Level, SchedulerConfig
from healer.gang.gangs import build_gangs
from healer.gang.placement import Placement, Placer, Unfit
from healer.gang.reason import TIMES
from healer.gang.records import NodeRecord, PodGroupRecord, PodRecord, Snapshot
from healer.gang.reservations import Reservation
from healer.gang.state import ClusterState
from tests.gang_builders import MakeNode, MakePod, MakePodGroup, gang, rack


def place(nodes: list[NodeRecord], pods: list[PodRecord], groups: list[PodGroupRecord] | None = None,
          reservations: list[Reservation] | None = None) -> dict[str, Placement | Unfit]:
    """Run the placer over the gangs in queue order; key by gang name."""
    snap = Snapshot(tuple(nodes), tuple(pods), tuple(groups or ()))
    cfg = SchedulerConfig()
    placer = Placer(ClusterState(snap, cfg, reservations or ()))
    return {g.name: placer.place(g) for g in build_gangs(snap, cfg)}


def nodes_of(p: Placement | Unfit) -> Counter[str]:
    assert isinstance(p, Placement), p
    return Counter(b.node for b in p.bindings)


def leaf_of(node: str) -> str:
    return node.rsplit("-n", 1)[0]


ALL_OR_NOTHING = [
    # (case, nodes, pods, groups, placed?)
    ("fits exactly", rack("l1", 2), gang("a", 2), [], True),
    ("one pod too many", rack("l1", 2), gang("a", 3), [], False),
    ("min member waits for pods", rack("l1", 4), gang("a", 2),
     [MakePodGroup("a").min_member(3).obj()], False),
    ("min member of 2 out of 3 fits", rack("l1", 2), gang("a", 3),
     [MakePodGroup("a").min_member(2).obj()], True),
    ("volcano annotation groups pods", rack("l1", 1),
     [MakePod(f"v-{i}").volcano_group("v").gpus(8).obj() for i in range(2)], [], False),
    ("ungrouped pod is its own gang", rack("l1", 1), [MakePod("solo").gpus(8).obj()], [], True),
    ("other scheduler's pods are ignored", rack("l1", 1), [MakePod("x").scheduler("default").gpus(8).obj()],
     [], None),
]


@pytest.mark.parametrize(("case", "nodes", "pods", "groups", "placed"), ALL_OR_NOTHING,
                         ids=[c[0] for c in ALL_OR_NOTHING])
def test_all_or_nothing(case: str, nodes: list[NodeRecord], pods: list[PodRecord],
                        groups: list[PodGroupRecord], placed: bool | None) -> None:
    out = place(nodes, pods, groups)
    if placed is None:
        assert out == {}
        return
    (result,) = out.values()
    assert isinstance(result, Placement) is placed, result
    if isinstance(result, Placement):
        assert len(result.bindings) == min(len(pods), groups[0].min_member if groups else len(pods))


def test_min_member_places_required_subset_when_all_do_not_fit() -> None:
    result = place(rack("l1", 2), gang("a", 3), [MakePodGroup("a").min_member(2).obj()])["a"]
    assert isinstance(result, Placement)
    assert [b.pod.name for b in result.bindings] == ["a-0", "a-1"]


def test_unfit_gang_stages_nothing_so_the_next_gang_gets_the_nodes() -> None:
    small = [MakePod(f"small-{i}").group("small").gpus(8).created(1).obj() for i in range(2)]
    pods = [*gang("big", 3), *small]
    out = place(rack("l1", 2), pods)
    assert isinstance(out["big"], Unfit)
    assert sum(nodes_of(out["small"]).values()) == 2


FILTERS = [
    ("cordoned node is skipped", [MakeNode("a").cordoned().obj(), MakeNode("b").obj()], MakePod("p"), "b"),
    ("NoSchedule taint blocks", [MakeNode("a").taint("gpu", "bad").obj(), MakeNode("b").obj()],
     MakePod("p"), "b"),
    ("NoExecute taint blocks", [MakeNode("a").taint("x", "", "NoExecute").obj(), MakeNode("b").obj()],
     MakePod("p"), "b"),
    ("PreferNoSchedule does not block", [MakeNode("a").taint("x", "", "PreferNoSchedule").obj()],
     MakePod("p"), "a"),
    ("Equal toleration matches value", [MakeNode("a").taint("gpu", "h100").obj()],
     MakePod("p").tolerate("gpu", "h100"), "a"),
    ("Equal toleration with wrong value", [MakeNode("a").taint("gpu", "h100").obj()],
     MakePod("p").tolerate("gpu", "a100"), None),
    ("Exists toleration ignores value", [MakeNode("a").taint("gpu", "h100").obj()],
     MakePod("p").tolerate("gpu", exists=True), "a"),
    ("empty-key Exists tolerates all", [MakeNode("a").taint("k1", "v").taint("k2", "", "NoExecute").obj()],
     MakePod("p").tolerate(exists=True), "a"),
    ("toleration effect must match", [MakeNode("a").taint("gpu", "h100", "NoExecute").obj()],
     MakePod("p").tolerate("gpu", "h100", "NoSchedule"), None),
    ("nodeSelector", [MakeNode("a").obj(), MakeNode("b").label("pool", "h100").obj()],
     MakePod("p").selector("pool", "h100"), "b"),
    ("affinity In", [MakeNode("a").label("gpu", "a100").obj(), MakeNode("b").label("gpu", "h100").obj()],
     MakePod("p").affinity(("gpu", "In", ("h100", "h200"))), "b"),
    ("affinity NotIn matches missing label", [MakeNode("a").label("gpu", "a100").obj(), MakeNode("b").obj()],
     MakePod("p").affinity(("gpu", "NotIn", ("a100",))), "b"),
    ("affinity Exists", [MakeNode("a").obj(), MakeNode("b").label("ib", "yes").obj()],
     MakePod("p").affinity(("ib", "Exists", ())), "b"),
    ("affinity DoesNotExist", [MakeNode("a").label("drain", "1").obj(), MakeNode("b").obj()],
     MakePod("p").affinity(("drain", "DoesNotExist", ())), "b"),
    ("affinity Gt", [MakeNode("a").label("cuda", "11").obj(), MakeNode("b").label("cuda", "12").obj()],
     MakePod("p").affinity(("cuda", "Gt", ("11",))), "b"),
    ("affinity terms are ORed", [MakeNode("a").label("x", "1").obj(), MakeNode("b").obj()],
     MakePod("p").affinity(("x", "In", ("2",))).affinity(("x", "In", ("1",))), "a"),
    ("requirements in a term are ANDed", [MakeNode("a").label("x", "1").obj(),
                                          MakeNode("b").label("x", "1").label("y", "1").obj()],
     MakePod("p").affinity(("x", "In", ("1",)), ("y", "Exists", ())), "b"),
    ("extended resource", [MakeNode("a").obj(), MakeNode("b").resource("rdma/ib", 4).obj()],
     MakePod("p").request("rdma/ib", 1), "b"),
    ("too few GPUs", [MakeNode("a").gpus(4).obj(), MakeNode("b").obj()], MakePod("p").gpus(8), "b"),
    ("memory", [MakeNode("a").resource("memory", 2**30).obj(), MakeNode("b").obj()],
     MakePod("p").request("memory", 2**31), "b"),
    ("pod count", [MakeNode("a").resource("pods", 0).obj(), MakeNode("b").obj()], MakePod("p"), "b"),
    ("spare never takes a new pod", [MakeNode("a").spare().obj()], MakePod("p").tolerate(exists=True), None),
]


@pytest.mark.parametrize(("case", "nodes", "pod", "expect"), FILTERS, ids=[c[0] for c in FILTERS])
def test_filters(case: str, nodes: list[NodeRecord], pod: MakePod, expect: str | None) -> None:
    (result,) = place(nodes, [pod.obj()]).values()
    if expect is None:
        assert isinstance(result, Unfit), result
    else:
        assert set(nodes_of(result)) == {expect}


def test_bound_and_terminating_pods_hold_resources() -> None:
    nodes = [MakeNode("a").obj(), MakeNode("b").obj(), MakeNode("c").obj()]
    running = MakePod("old").gpus(8).scheduler("default").on("a").obj()
    going = MakePod("going").gpus(8).scheduler("default").on("b").terminating().obj()
    out = place(nodes, [running, going, *gang("g", 1)])
    assert set(nodes_of(out["g"])) == {"c"}


def test_nodes_with_terminating_pods_are_closed_to_new_gangs() -> None:
    # Node a still has 4 GPUs free, but a pod there is terminating: a new gang must not use it.
    nodes = [MakeNode("a").obj()]
    going = MakePod("going").gpus(4).scheduler("default").on("a").terminating().obj()
    (result,) = place(nodes, [going, *gang("g", 1, gpus=4)]).values()
    assert isinstance(result, Unfit)
    assert "1 draining terminating pods" in result.reason


TOPOLOGY = [
    # (case, nodes, gang size, expected leaves spanned, expected level)
    ("fits one leaf: the tightest", [*rack("l1", 8), *rack("l2", 4)], 4, {"l2"}, Level.LEAF),
    ("spans two leaves in one spine before two spines",
     [*rack("l1", 3, "s1"), *rack("l2", 3, "s1"), *rack("l3", 5, "s2")], 6, {"l1", "l2"}, Level.SPINE),
    ("fewest leaves in the spine", [*rack("l1", 2), *rack("l2", 5), *rack("l3", 5)], 8, None, Level.SPINE),
    ("zone when no spine holds it", [*rack("l1", 3, "s1", "z1"), *rack("l2", 3, "s2", "z1"),
                                     *rack("l3", 2, "s3", "z2")], 6, {"l1", "l2"}, Level.ZONE),
    ("cluster when no zone holds it", [*rack("l1", 3, "s1", "z1"), *rack("l2", 3, "s2", "z2")], 6,
     {"l1", "l2"}, Level.CLUSTER),
]


@pytest.mark.parametrize(("case", "nodes", "k", "leaves", "level"), TOPOLOGY, ids=[c[0] for c in TOPOLOGY])
def test_topology_minimality(case: str, nodes: list[NodeRecord], k: int, leaves: set[str] | None,
                             level: Level) -> None:
    result = place(nodes, gang("g", k))["g"]
    assert isinstance(result, Placement), result
    used = {leaf_of(n) for n in nodes_of(result)}
    if leaves is not None:
        assert used == leaves
    assert result.level == level
    assert result.leaves == result.leaves_lower_bound == len(used)


def test_bin_packs_partial_nodes_inside_a_leaf() -> None:
    nodes = rack("l1", 3)
    busy = [MakePod("busy").gpus(6).scheduler("default").on("l1-n1").obj()]
    result = place(nodes, [*busy, *gang("g", 2, gpus=1)])["g"]
    # Two 1-GPU pods go on the node with exactly 2 free GPUs, leaving whole nodes whole.
    assert nodes_of(result) == Counter({"l1-n1": 2})


def test_consecutive_ranks_share_nodes_then_leaves() -> None:
    result = place([*rack("l1", 2), *rack("l2", 2)], gang("g", 16, gpus=2))["g"]
    assert isinstance(result, Placement)
    order = [b.node for b in sorted(result.bindings, key=lambda b: int(b.pod.name.split("-")[1]))]
    assert order == sorted(order, key=order.index) and len({*order[:4]}) == 1


def test_required_topology_gives_numeric_reason() -> None:
    nodes = [*rack("l1", 3, "s1"), *rack("l2", 3, "s2")]
    pg = MakePodGroup("g").min_member(4).required_topology("spine").obj()
    result = place(nodes, gang("g", 4), [pg])["g"]
    assert isinstance(result, Unfit)
    assert result.reason == f"needs 4 pods {TIMES} 8 GPUs within one spine; best spine has room for 3"


def test_reason_counts_room_and_ruled_out_nodes() -> None:
    nodes = [*rack("l1", 2), MakeNode("c").leaf("l2").cordoned().obj(),
             MakeNode("t").leaf("l2").taint("bad").obj()]
    result = place(nodes, gang("g", 3))["g"]
    assert isinstance(result, Unfit)
    assert result.reason == (f"needs 3 pods {TIMES} 8 GPUs; room for 2 (best spine 2, best leaf 2); "
                             "ruled out: 1 cordoned, 1 by taints, selector or affinity")


def test_min_resources_is_checked_first() -> None:
    pg = MakePodGroup("g").min_member(1).min_resources(nvidia_gpu=16).obj()
    result = place(rack("l1", 1), gang("g", 1), [pg])["g"]
    assert isinstance(result, Unfit)
    assert result.reason == "PodGroup minResources needs 16 nvidia.com/gpu; 8 free on open nodes"


def test_priority_then_age_order() -> None:
    pods = [*[MakePod(f"old-{i}").group("old").gpus(8).created(1).obj() for i in range(2)],
            *[MakePod(f"new-{i}").group("new").gpus(8).created(2).obj() for i in range(2)],
            *[MakePod(f"vip-{i}").group("vip").gpus(8).created(3).priority(100).obj() for i in range(2)]]
    out = place(rack("l1", 4), pods)
    assert list(out) == ["vip", "old", "new"]
    assert isinstance(out["vip"], Placement) and isinstance(out["old"], Placement)
    assert isinstance(out["new"], Unfit)


SPARE_NODES = [*rack("l1", 4), MakeNode("l1-spare").leaf("l1").spare().obj(),
               *rack("l2", 4), MakeNode("l2-spare").leaf("l2").spare().obj()]


def test_spares_replace_failed_member_in_the_gangs_leaf() -> None:
    # The job ran on l1-n0..n3; l1-n3 failed and is cordoned; l2 has free nodes too.
    failed = MakeNode("l1-n3").leaf("l1").cordoned().obj()
    nodes = [failed if n.name == "l1-n3" else n for n in SPARE_NODES]
    hold = Reservation("train/job", frozenset({"l1-n0", "l1-n1", "l1-n2"}), frozenset({"l1-n3"}))
    result = place(nodes, gang("job", 4), reservations=[hold])["job"]
    assert isinstance(result, Placement)
    assert set(nodes_of(result)) == {"l1-n0", "l1-n1", "l1-n2", "l1-spare"}
    assert result.spares == ("l1-spare",)


def test_spare_in_another_leaf_before_a_healthy_free_node() -> None:
    nodes = [*(n for n in SPARE_NODES if n.name != "l1-spare")]
    hold = Reservation("train/job", frozenset({"l1-n0", "l1-n1", "l1-n2"}), frozenset({"l1-n3"}))
    busy = MakePod("busy").gpus(8).scheduler("default").on("l1-n3").obj()
    result = place(nodes, [busy, *gang("job", 4)], reservations=[hold])["job"]
    assert set(nodes_of(result)) == {"l1-n0", "l1-n1", "l1-n2", "l2-spare"}


def test_held_nodes_are_not_given_to_other_gangs() -> None:
    hold = Reservation("train/job", frozenset({"l1-n0", "l1-n1"}))
    out = place(rack("l1", 3), [*gang("job", 3, priority=0, created=5.0), *gang("thief", 2, created=1.0)],
                reservations=[hold])
    assert isinstance(out["thief"], Unfit)
    assert "2 held for restarting gangs" in out["thief"].reason
    assert set(nodes_of(out["job"])) == {"l1-n0", "l1-n1", "l1-n2"}


def test_restarting_gang_waits_for_its_old_pods() -> None:
    hold = Reservation("train/job", frozenset({"l1-n0", "l1-n1"}), frozenset({"l1-n2"}))
    old = MakePod("job-old").gpus(8).scheduler("default").on("l1-n0").terminating().obj()
    result = place([*rack("l1", 4), MakeNode("sp").leaf("l1").spare().obj()], [old, *gang("job", 3)],
                   reservations=[hold])["job"]
    assert isinstance(result, Unfit)
    assert "terminate" in result.reason


def test_new_member_of_running_gang_goes_near_it_without_spares() -> None:
    running = [MakePod(f"job-{i}").group("job").gpus(8).on(f"l2-n{i}").obj() for i in range(3)]
    pg = MakePodGroup("job").min_member(4).obj()
    result = place(SPARE_NODES, [*running, MakePod("job-3").group("job").gpus(8).obj()], [pg])["job"]
    assert set(nodes_of(result)) == {"l2-n3"}
