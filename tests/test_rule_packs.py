"""Shipped rule packs: they load through the real loader, every example and counter-example
behaves through the multi-pattern engine, every rule cites a real source, and benign lines are silent."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.engine import Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.rules import Rule, default_rules_dir, load_pack, load_rules

PACKS = sorted(default_rules_dir().glob("*.yaml"))
BENIGN = Path(__file__).parent / "data" / "benign.log"


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


@pytest.mark.parametrize("pack", PACKS, ids=lambda p: p.stem)
def test_every_shipped_pack_loads(pack: Path) -> None:
    loaded = load_pack(pack)
    assert loaded, f"{pack.name} has no rules"
    for rule in loaded:
        assert rule.examples and rule.references
        assert all(ref.startswith("https://") for ref in rule.references)


def test_the_issue_categories_are_covered(rules: list[Rule]) -> None:
    ids = {r.id for r in rules}
    wanted = {
        "xid-13", "xid-48", "xid-79", "xid-154", "xid-149", "nvswitch-sxid-fatal", "fabric-manager-failed",
        "cuda-nvlink-uncorrectable", "pcie-aer-corrected", "pcie-aer-uncorrected-nonfatal", "pcie-aer-fatal",
        "pcie-link-down", "pcie-bandwidth-limited", "pcie-surprise-removal", "nccl-ib-retry-exceeded",
        "nccl-ib-port-error", "ibv-call-failed", "roce-gid-error", "mlx5-command-timeout",
        "nccl-watchdog-timeout", "nccl-communicator-aborted", "nccl-unhandled-system-error",
        "nccl-internal-error", "nccl-remote-error", "nccl-cuda-failure", "cuda-oom",
        "cuda-illegal-memory-access", "cuda-device-side-assert", "cuda-unknown-error",
        "cuda-uncorrectable-ecc",
        "cuda-no-device", "cudnn-failure", "cublas-failure", "torchrun-child-failed", "host-oom-killer",
        "host-hung-task", "host-soft-lockup", "host-mce", "host-edac-ue", "host-kernel-panic",
        "nfs-not-responding", "stale-file-handle", "ext4-error", "xfs-corruption", "no-space-left",
        "checkpoint-corrupt", "cpu-thermal-throttle", "nvidia-smi-device-handle", "nvidia-smi-no-devices",
    }
    assert wanted <= ids, sorted(wanted - ids)


@pytest.mark.parametrize("backend", available_backends(), ids=str)
def test_examples_match_and_counter_examples_do_not_through_the_engine(
    rules: list[Rule], backend: Backend,
) -> None:
    engine = MultiMatcher(rules, backend=backend)
    for rule in rules:
        hits = engine.scan(list(rule.examples))
        for i, line in enumerate(rule.examples):
            assert any(h.line == i and h.rule.id == rule.id for h in hits), f"{rule.id} missed {line!r}"
        hits = engine.scan(list(rule.counter_examples))
        assert not [h for h in hits if h.rule.id == rule.id], f"{rule.id} fired on a counter-example"


@pytest.mark.parametrize("backend", available_backends(), ids=str)
def test_engine_agrees_with_the_naive_loop_on_every_line_we_know(rules: list[Rule], backend: Backend) -> None:
    lines = [ln for r in rules for ln in (*r.examples, *r.counter_examples)]
    lines += BENIGN.read_text().splitlines()
    naive = [(m.line, m.rule.id) for m in NaiveMatcher(rules).scan(lines)]
    fast = [(m.line, m.rule.id) for m in MultiMatcher(rules, backend=backend).scan(lines)]
    assert fast == naive


def test_benign_look_alikes_produce_nothing(rules: list[Rule]) -> None:
    lines = BENIGN.read_text().splitlines()
    assert len(lines) > 20
    assert MultiMatcher(rules).scan(lines) == []
    assert MultiMatcher(rules).scan_buffer(BENIGN.read_bytes()) == []


def test_hardware_depends_rules_either_escalate_or_are_symptoms(rules: list[Rule]) -> None:
    # "depends" must be decidable: by repeats on one device, or by folding under a cause.
    for r in rules:
        if r.hardware == "depends":
            assert r.escalation or r.symptom_of, r.id
