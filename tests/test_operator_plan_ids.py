"""An operator's plans made in the same clock tick (quarantine, release, quarantine again, release again, each with
the node's health check after its release) get their own ids: the journal keeps every one, each release makes its
own writes, and none overwrites another."""

from __future__ import annotations

from pathlib import Path

from healer.acceptance import Candidate, acceptance_plan
from healer.policy import RELEASE_POLICY
from healer.records import PlanState
from tests.healing import Harness

NODE = "gpu-node-03"


def test_two_releases_of_a_node_in_one_clock_tick_are_two_plans(tmp_path: Path) -> None:
    h = Harness(tmp_path)  # its clock stands still unless the test moves it
    heal = h.healing()
    made = []
    for _ in range(2):
        made.append(heal.quarantine(NODE, "alice", "flapping NIC").id)
        assert h.cluster.get_node(NODE).unschedulable
        heal.release(NODE, "alice")
        assert not h.cluster.get_node(NODE).unschedulable  # the second release uncordons the second quarantine
        [release] = {p.id for p in h.store.list_plans(node=NODE) if p.policy == RELEASE_POLICY} - set(made)
        made.append(release)
    assert len(set(made)) == 4, made
    plans = {p.id: p for p in h.store.list_plans(node=NODE)}
    assert set(made) <= set(plans), (made, list(plans))
    assert [plans[pid].state for pid in made] == [PlanState.SUCCEEDED] * 4
    events = [e.reason for e in h.cluster.events if e.node == NODE]
    assert events.count("KmendReleased") == 2 and events.count("KmendQuarantine") == 2, events


def test_health_checks_of_a_node_in_one_clock_tick_are_two_plans(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    ids = {acceptance_plan(Candidate(NODE, "repaired"), h.policy, h.clock()).id for _ in range(2)}
    assert len(ids) == 2, ids
