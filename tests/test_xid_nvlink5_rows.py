"""NVLink5 Xids 144-150, one case per row of NVIDIA's decode table: a line carrying the row's
IntrInfo and error status gets the action and hardware call the row's resolution implies."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from analyzer.matcher import FastMatcher
from analyzer.pipeline import Analyzer
from analyzer.records import Action
from analyzer.rules import Rule, default_rules_dir, load_pack
from collector.signal import LogLine, Signal, Source

DECODE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "nvidia-xid-144-150-decode.csv"


def _rows() -> list[dict[str, str]]:
    if not DECODE.exists():
        return []
    with DECODE.open(newline="") as f:
        return list(csv.DictReader(f))


def _cases() -> list[object]:
    out: list[object] = []
    for n, r in enumerate(_rows(), start=2):
        for which, (v1, v2, recovery) in {
            "action": (r["intrinfo_v1_pre_r575"], r["intrinfo_v2_r575_plus"], r["recovery_action"]),
            "action2": (r["action2_intrinfo_v1"], r["action2_intrinfo_v2"], r["action2"]),
        }.items():
            if not recovery:
                continue
            for fmt, pattern in (("pre-r575", v1), ("r575", v2)):
                status = (r["error_status"].split("/") or ["0"])[0] or "0x00000000"
                out.append(pytest.param(r, pattern, status, recovery,
                                        id=f"row{n}-xid{r['xid']}-{r['unit']}-{status}-{which}-{fmt}"))
    return out


# The table's resolution, in our actions: reset when it says reset; when the recovery is IGNORE
# but the investigation is not, nothing is reset but the operator is told; Xid 154's evaluation
# is reported for the operator to follow; IGNORE with nothing to investigate is no action.
def _expected_action(recovery: str, investigatory: str) -> Action:
    if recovery == "RESET_GPU":
        return Action.RESET_GPU
    if recovery == "XID_154_EVAL":
        return Action.NOTIFY
    return Action.NONE if investigatory in ("", "IGNORE") else Action.NOTIFY


@pytest.fixture(scope="module")
def xid_rules() -> list[Rule]:
    return load_pack(default_rules_dir() / "nvidia-xid.yaml")


@pytest.fixture(scope="module")
def matcher(xid_rules: list[Rule]) -> FastMatcher:
    return FastMatcher(xid_rules)


@pytest.mark.skipif(not DECODE.exists(), reason=f"decode table not found at {DECODE}")
@pytest.mark.parametrize(("row", "pattern", "status", "recovery"), _cases())
def test_each_decode_row_gets_the_action_its_resolution_implies(
        xid_rules: list[Rule], matcher: FastMatcher, row: dict[str, str], pattern: str, status: str,
        recovery: str) -> None:
    intrinfo = int(pattern.replace("-", "0"), 2)
    fatality = "Nonfatal" if row["severity"].lower().startswith("non") else "Fatal"
    line = (f"NVRM: Xid (PCI:0018:01:00): {row['xid']}, {row['unit'].split()[0]} {fatality} XC0 i0 Link 13 "
            f"(0x{intrinfo:08x} 0x{int(status, 16):08x} 0x00000000 0x00000000 0x00000000 0x00000000)")
    sig = Signal(id="n1:k:0", node="n1", source=Source.KERNEL, ts=100.0, payload=LogLine(text=line))
    [f] = Analyzer(xid_rules, matcher=matcher).findings([sig])
    # The table itself gives two units the same registers in places (TLW pipes before R575, MSE).
    same = {o["unit"] for o in _rows() if o["xid"] == row["xid"] and status in o["error_status"].split("/")
            and pattern in (o["intrinfo_v1_pre_r575"], o["intrinfo_v2_r575_plus"])}
    assert f.rule_id == f"xid-{row['xid']}" and f.fields.get("decoded_unit") in same | {row["unit"]}, line
    assert f.recommended_action is _expected_action(recovery, row["investigatory_action"].strip()), line
    hw = {"HW": True, "FW": True, "SW": False, "NA": False}.get(row["hw_sw"])
    if hw is not None:
        assert f.hardware is hw, line
