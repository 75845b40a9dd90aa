"""Storage lines whose cause lies elsewhere: a write the block layer refused as invalid (a driver stacked on
the disk built it) is no disk fault, and an NFS server "not responding" because the client's own transmit queue
wedged folds under the network finding that caused it (development excerpts of the corpus)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from analyzer.pipeline import Analyzer
from analyzer.records import Incident
from analyzer.rules import Rule, default_rules_dir, load_rules
from kmend.corpus_eval import load_corpus, run_entries
from tests.builders import kernel

CORPUS = Path(__file__).resolve().parent / "corpus"
T0 = 1_700_000_000.0
NODE = "gpu-node-07"
# https://github.com/QubesOS/qubes-issues/issues/7795: BLK_STS_IOERR (10), the disk failed the write
EXT4_EIO = ("[  296.444490] EXT4-fs warning (device dm-4): ext4_end_bio:343: I/O error 10 writing to inode 1182507 "
            "starting block 2920460)")
# https://github.com/Peppershade/abb-linux-agent/issues/11: BLK_STS_INVAL (19), a snapshot driver's request
EXT4_INVAL = ("EXT4-fs warning (device dm-0): ext4_end_bio:368: I/O error 19 writing to inode 3670128 "
              "starting block 25830417)")
# https://github.com/openrisc/linux/issues/12
NFS = "[90434.910000] nfs: server 10.0.0.27 not responding, still trying"
# https://github.com/openbmc/openbmc/issues/3192
WATCHDOG = "[   91.153715] NETDEV WATCHDOG: eth0 (ftgmac100): transmit queue 0 timed out"


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


@functools.cache
def _outcome(entry_id: str) -> tuple[object, ...]:
    [entry] = [e for e in load_corpus(CORPUS) if e.id == entry_id]
    assert entry.split == "dev"
    [o] = run_entries([entry], [default_rules_dir()])
    return o.fault_class, o.hardware, o.rule, o.ok


def _incidents(rules: list[Rule], lines: list[tuple[str, float]]) -> list[Incident]:
    analyzer = Analyzer(rules)
    analyzer.process([kernel(NODE, text, ts) for text, ts in lines])
    return list(analyzer.correlator.incidents())


def test_a_write_the_block_layer_refused_as_invalid_is_no_disk_fault(rules: list[Rule]) -> None:
    [inc] = _incidents(rules, [(EXT4_INVAL, T0)])
    assert (inc.fault_class.value, inc.hardware, inc.root_finding.rule_id) == (
        "storage", False, "block-request-invalid")
    [eio] = _incidents(rules, [(EXT4_EIO, T0)])
    assert (eio.hardware, eio.root_finding.rule_id) == (True, "ext4-write-io-error"), "an I/O error stays the disk's"


def test_the_snapshot_driver_thread_gets_the_software_call() -> None:
    # abb-linux-agent#11: the snapshot module's writes fail as invalid; ext4 and the buffer cache report lost writes
    fault_class, hardware, rule, ok = _outcome("abb-linux-agent-11-snapshot-io-error-ext4")
    assert (str(fault_class), hardware, rule, ok) == ("storage", False, "block-request-invalid", True)


def test_nfs_not_responding_folds_under_the_transmit_watchdog_of_the_same_node(rules: list[Rule]) -> None:
    incidents = _incidents(rules, [(NFS, T0), (WATCHDOG, T0 + 0.02)])
    [inc] = incidents
    assert (inc.fault_class.value, inc.root_finding.rule_id) == ("network", "netdev-tx-watchdog")
    assert {f.rule_id for f in inc.findings} == {"netdev-tx-watchdog", "nfs-not-responding"}
    [alone] = _incidents(rules, [(NFS, T0)])
    assert (alone.fault_class.value, alone.root_finding.rule_id) == ("storage", "nfs-not-responding")


def test_the_wedged_ethernet_driver_thread_is_a_network_fault() -> None:
    # openrisc/linux#9: the NFS root stops answering because no packet leaves the wedged ethoc interface
    fault_class, hardware, rule, ok = _outcome("openrisc-9-ethoc-watchdog-nfs-stall")
    assert (str(fault_class), hardware, rule, ok) == ("network", False, "netdev-tx-watchdog", True)
