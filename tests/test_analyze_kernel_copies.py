"""`kmend analyze` on a node's bundle that holds the same kernel messages several times, as collectors copy them
(syslog, kern.log and dmesg, real corpus lines): each event is reported once, an Xid 48 escalated by the Xid 64
beside it is one xid-48 finding, and dmesg's seconds-since-boot stamps are put on the wall clock from the
boot time the bundle shows (a syslog line with both stamps, or a copy of /proc/stat)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.test_analyze_ordinary_bundle import _analyze, _corpus_lines, _epoch, _findings

SYSLOG = _corpus_lines("gpu-memory", "gpu-operator-1146-xid48-dbe")
"""Dec  2 11:38:47 worker4 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 48, ... and its Xid 64."""
DMESG = [re.sub(r"^.*? kernel: ", "", ln) for ln in SYSLOG]
"""The same two messages as ``dmesg`` prints them: ``[  219.470994] NVRM: Xid ...``."""
WALL = _epoch("2025-12-02T11:38:47")


def _node(root: Path, files: dict[str, list[str]]) -> Path:
    node = root / "worker4"
    node.mkdir(parents=True)
    for name, lines in files.items():
        (node / name).write_text("\n".join(lines) + "\n")
        os.utime(node / name, (_epoch("2025-12-02T12:00:00"),) * 2)
    return root


def _rules(result: dict[str, object]) -> list[str]:
    return sorted(f["rule_id"] for f in _findings(result))  # type: ignore[arg-type]


def test_one_syslog_line_is_one_xid_48_finding(tmp_path: Path) -> None:
    _, result = _analyze(str(_node(tmp_path / "b", {"syslog": SYSLOG})))
    assert _rules(result) == ["xid-48", "xid-64"]
    [xid48] = [f for f in _findings(result) if f["rule_id"] == "xid-48"]
    assert xid48["recommended_action"] == "replace_node"  # the escalation, naming both lines
    assert len(xid48["evidence"]) == 2


@pytest.mark.parametrize("copies", [["syslog", "kern.log"], ["syslog", "kern.log", "dmesg"], ["dmesg", "syslog"]])
def test_a_kernel_message_copied_into_several_files_is_reported_once(tmp_path: Path, copies: list[str]) -> None:
    files = {name: DMESG if name == "dmesg" else SYSLOG for name in copies}
    code, result = _analyze(str(_node(tmp_path / "b", files)))
    assert code == 3
    assert len(result["incidents"]) == 1
    assert _rules(result) == ["xid-48", "xid-64"]


def test_dmesg_stamps_take_the_boot_time_a_syslog_line_gives(tmp_path: Path) -> None:
    # The syslog holds an earlier, unrelated kernel line with both stamps; dmesg holds the Xid lines.
    other = "Dec  2 11:35:10 worker4 kernel: [    2.250000] EXT4-fs (nvme0n1p1): mounted filesystem"
    _, result = _analyze(str(_node(tmp_path / "b", {"syslog": [other], "dmesg": DMESG})))
    ts = sorted(f["ts"] for f in _findings(result))
    boot = _epoch("2025-12-02T11:35:10") - 2.25
    assert ts[0] == pytest.approx(boot + 219.470994, abs=1e-3)
    assert ts[0] == pytest.approx(WALL, abs=1.0)


def test_dmesg_stamps_take_the_boot_time_of_a_proc_stat_copy(tmp_path: Path) -> None:
    btime = 1764675000
    stat = ["cpu  1 2 3 4 5 6 7 0 0 0", f"btime {btime}", "processes 4242"]
    _, result = _analyze(str(_node(tmp_path / "b", {"stat": stat, "dmesg": DMESG})))
    assert min(f["ts"] for f in _findings(result)) == pytest.approx(btime + 219.470994, abs=1e-3)
