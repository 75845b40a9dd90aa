"""`kmend analyze` on a bundle as an operator collects it — a node's syslog beside its pods' logs, real corpus lines:
syslog stamps (no year) are dated from the bundle's dated lines or the file's mtime, the node comes from the
hostnames in the lines and the bundle's layout, so cause and symptom line up in a real correlation window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from collector.bundle_time import place_year
from tests.conftest import REPO

CORPUS = REPO / "tests" / "corpus"
UID = "0f6e1c2a-0000-4000-8000-000000000001"


def _corpus_lines(family: str, entry_id: str) -> list[str]:
    entries = yaml.safe_load((CORPUS / f"{family}.yaml").read_text())["entries"]
    [entry] = [e for e in entries if e["id"] == entry_id]
    lines: list[str] = entry["text"].splitlines()
    return lines


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()


def _write(root: Path, *, cri_day: str = "2025-12-02", mtime: str = "2025-12-02T12:00:00",
           pods: bool = True) -> Path:
    """worker4's syslog (Xid 48 and 64, verbatim) at the bundle's top, and a pod log whose ranks time out ten
    minutes later (verbatim lines behind the CRI prefix kubelet writes)."""
    root.mkdir(parents=True)
    syslog = root / "syslog"
    syslog.write_text("\n".join(_corpus_lines("gpu-memory", "gpu-operator-1146-xid48-dbe")) + "\n")
    os.utime(syslog, (_epoch(mtime),) * 2)
    if pods:
        d = root / "pods" / f"train_llama-worker-0_{UID}" / "trainer"
        d.mkdir(parents=True)
        lines = _corpus_lines("nccl-timeout", "llamafactory-6269-watchdog-reduce-scatter")
        d.joinpath("0.log").write_text("".join(f"{cri_day}T11:48:5{i}.000000000Z stderr F {ln}\n"
                                               for i, ln in enumerate(lines)))
    return root


def _analyze(*args: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "kmend.cli", "analyze", "--format", "json", *args],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode in (0, 3, 4), out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return out.returncode, result


def _findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for inc in result["incidents"] for f in inc["findings"]]


def test_syslog_lines_take_the_year_of_the_pod_logs_and_fold_into_one_incident(tmp_path: Path) -> None:
    bundle = _write(tmp_path / "bundle")
    # A real correlation window (15 min), not the whole bundle: the Xid must precede its symptoms in time.
    code, result = _analyze(str(bundle), "--window", "900")
    assert code == 3  # a hardware fault
    [incident] = result["incidents"]
    assert incident["hardware"] is True and incident["root_cause"]["node"] == "worker4"
    by_rule = {f["rule_id"]: f for f in incident["findings"]}
    xid, timeout = by_rule["xid-48"], by_rule["nccl-watchdog-timeout"]
    assert datetime.fromtimestamp(xid["ts"], UTC) == datetime(2025, 12, 2, 11, 38, 47, tzinfo=UTC)
    assert 0 < timeout["ts"] - xid["ts"] < 900
    # No finding sits in a year nobody logged in, and every one is on worker4 (syslog host, then the only node).
    assert {datetime.fromtimestamp(f["ts"], UTC).year for f in _findings(result)} == {2025}
    assert {f["node"] for f in _findings(result)} == {"worker4"}


def test_dated_lines_beat_the_mtime_of_a_copied_file(tmp_path: Path) -> None:
    # The bundle was copied a year and a half later: the pod logs still say 2025.
    bundle = _write(tmp_path / "bundle", mtime="2027-06-01T09:00:00")
    _, result = _analyze(str(bundle), "--window", "900")
    xid = next(f for f in _findings(result) if f["rule_id"] == "xid-48")
    assert datetime.fromtimestamp(xid["ts"], UTC).year == 2025


def test_a_syslog_alone_is_dated_by_its_mtime(tmp_path: Path) -> None:
    bundle = _write(tmp_path / "bundle", mtime="2026-01-03T08:00:00", pods=False)
    code, result = _analyze(str(bundle / "syslog"))
    assert code == 3
    # Written on 2 December before the file's last change in January 2026: December 2025.
    xid = next(f for f in _findings(result) if f["rule_id"] == "xid-48")
    assert datetime.fromtimestamp(xid["ts"], UTC) == datetime(2025, 12, 2, 11, 38, 47, tzinfo=UTC)
    assert xid["node"] == "worker4"


def test_place_year_keeps_lines_before_their_anchor() -> None:
    anchor = _epoch("2026-01-03T08:00:00")
    assert datetime.fromtimestamp(place_year(_epoch("2000-12-31T23:59:58"), anchor), UTC).year == 2025
    assert datetime.fromtimestamp(place_year(_epoch("2000-01-02T10:00:00"), anchor), UTC).year == 2026
    # 29 February exists in the reference year only in leap years: the latest leap year before the anchor.
    assert datetime.fromtimestamp(place_year(_epoch("2000-02-29T10:00:00"), anchor), UTC).year == 2024
