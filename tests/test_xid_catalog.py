"""The shipped Xid pack against NVIDIA's public Xid catalog: every code present, each bucket
mapped to our action as documented, the 144-150 decode table carried over in full."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from analyzer.records import Action
from analyzer.rules import Rule, default_rules_dir, load_pack

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
CATALOG = DATA / "nvidia-xid-catalog.csv"
DECODE = DATA / "nvidia-xid-144-150-decode.csv"
needs_catalog = pytest.mark.skipif(
    not CATALOG.exists(), reason=f"NVIDIA Xid catalog not found at {CATALOG} (shared/ is the repo's sibling)")

BUCKET_ACTIONS = {
    "RESET_GPU": {Action.RESET_GPU},
    "RESTART_BM": {Action.REBOOT_NODE, Action.REPLACE_NODE},
    "RESTART_VM": {Action.REBOOT_NODE},
    "CONTACT_SUPPORT": {Action.REPLACE_NODE},
    "IGNORE": {Action.NONE},
    "RESTART_APP": {Action.RESTART_JOB, Action.FIX_APPLICATION},
    "WORKFLOW_XID_48": {Action.RESET_GPU},
}
APP_SIDE = {13, 31, 43, 45, 69, 94}


@pytest.fixture(scope="module")
def xids() -> dict[int, Rule]:
    return {int(r.id.split("-")[1]): r for r in load_pack(default_rules_dir() / "nvidia-xid.yaml")}


@pytest.fixture(scope="module")
def catalog() -> list[dict[str, str]]:
    with CATALOG.open(newline="") as f:
        return list(csv.DictReader(f))


@needs_catalog
def test_every_catalog_code_has_a_rule(xids: dict[int, Rule], catalog: list[dict[str, str]]) -> None:
    codes = {int(row["code"]) for row in catalog}
    assert codes == set(xids), f"missing {sorted(codes - set(xids))}, extra {sorted(set(xids) - codes)}"
    for row in catalog:
        rule = xids[int(row["code"])]
        assert dict(rule.fields)["mnemonic"] == row["mnemonic"]


@needs_catalog
def test_buckets_map_to_our_actions(xids: dict[int, Rule], catalog: list[dict[str, str]]) -> None:
    for row in catalog:
        code, bucket = int(row["code"]), row["immediate_action"]
        rule = xids[code]
        if code in APP_SIDE:
            assert rule.hardware == "depends" and rule.recommended_action is Action.FIX_APPLICATION
            assert rule.escalation is not None and rule.escalation.recommended_action is Action.REPLACE_NODE
        elif bucket in BUCKET_ACTIONS:
            assert rule.recommended_action in BUCKET_ACTIONS[bucket], (code, bucket, rule.recommended_action)


@needs_catalog
def test_the_nvlink5_decode_table_is_carried_over(xids: dict[int, Rule]) -> None:
    with DECODE.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for code in range(144, 151):
        decoder = xids[code].decoder
        assert decoder is not None
        want = [r for r in rows if int(r["xid"]) == code]
        assert len(decoder.rows) == len(want) + sum(1 for r in want if r["action2"])


def test_xid48_escalates_together_with_row_remap_xids(xids: dict[int, Rule]) -> None:
    esc = xids[48].escalation
    assert esc is not None and set(esc.together_with) == {"xid-63", "xid-64"}
    assert esc.recommended_action is Action.REPLACE_NODE


def test_codes_without_a_public_example_say_so(xids: dict[int, Rule]) -> None:
    for code, rule in xids.items():
        built = any(ex.startswith("NVRM: Xid (PCI:0000:3b:00): ") and "pid=4242" in ex
                    for ex in rule.examples)
        if built:
            assert "no public example line found" in rule.description, code
