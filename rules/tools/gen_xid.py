#!/usr/bin/env python3
"""Generate rules/nvidia-xid.yaml from NVIDIA's Xid catalog (one rule per Xid code).

    python3 rules/tools/gen_xid.py            # reads ../shared/data next to the repo root

The catalog's immediate-action bucket decides action, severity and whether the node's
hardware is at fault; the 144-150 decode table becomes each NVLink5 rule's `decode`.
Real example lines come from rules/tools/xid-examples.yaml; codes without one get an
example built in the documented NVRM format, and their description says so.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

# Application-side unless the same GPU repeats (NVIDIA's WORKFLOW_XID_13/31 and the
# sympathetic resets that follow an application's own fault).
APP_SIDE = {13, 31, 43, 45, 69, 94}
SYMPTOM_OF_OTHER_XID = {45}
LOST = {79}
MEMORY = {48, 63, 64, 92, 94, 95, 140, 156, 157, 168, 171, 172}
NVLINK = {74, 108, 136, 137, 144, 145, 146, 147, 148, 149, 150, 155, 166, 170}
THERMAL_POWER = {54, 162, 163, 164, 165}
PCIE = {167}

# Catalog bucket -> (action, hardware, severity). RESTART_APP is refined per code below.
BUCKETS: dict[str, tuple[str, bool | str, str]] = {
    "RESTART_APP": ("restart_job", False, "error"),
    "RESET_GPU": ("reset_gpu", True, "critical"),
    "RESTART_BM": ("reboot_node", True, "critical"),
    "RESTART_VM": ("reboot_node", True, "critical"),
    "CONTACT_SUPPORT": ("replace_node", True, "critical"),
    "CHECK_MECHANICALS": ("replace_node", True, "critical"),
    "WORKFLOW_XID_48": ("reset_gpu", True, "critical"),
    "WORKFLOW_XID_45": ("fix_application", "depends", "error"),
    "WORKFLOW_NVLINK_ERR": ("reset_gpu", True, "critical"),
    "WORKFLOW_NVLINK5_ERR": ("reset_gpu", True, "critical"),
    "XID_154": ("notify", True, "critical"),
    "IGNORE": ("none", False, "info"),
    "UPDATE_SWFW": ("notify", False, "warning"),
    "CHECK_UVM": ("notify", False, "warning"),
    "": ("notify", False, "warning"),
}

DECODE_ACTIONS = {"IGNORE": "none", "RESET_GPU": "reset_gpu", "XID_154_EVAL": "notify"}
# A row whose recovery is IGNORE but whose investigation is not (CONTACT_SUPPORT, INVESTIGATE_*,
# REPORT_ISSUE): nothing to reset now, but someone has to look, so the operator is told.
NOTHING_TO_INVESTIGATE = {"", "IGNORE"}
# The table's HW/SW column: HW or FW blames the GPU, SW or NA the software; HW/SW keeps the rule's call.
DECODE_HARDWARE: dict[str, bool | None] = {"HW": True, "FW": True, "SW": False, "NA": False, "HW/SW": None}
RECOVERY_ACTIONS = {  # NVML's GPU recovery action codes, as Xid 154 prints them
    "0": "none", "1": "reset_gpu", "2": "reboot_node", "3": "reset_gpu", "4": "replace_node",
}
SYMPTOM_CLASSES = ["gpu_lost", "gpu_memory", "gpu_hardware", "nvlink", "pcie"]


def fault_class(code: int) -> str:
    if code in LOST:
        return "gpu_lost"
    if code in APP_SIDE - MEMORY:
        return "app_error"
    if code in MEMORY:
        return "gpu_memory"
    if code in NVLINK:
        return "nvlink"
    if code in THERMAL_POWER:
        return "gpu_thermal_power"
    if code in PCIE:
        return "pcie"
    return "gpu_hardware"


def pattern(code: int) -> str:
    head = r"NVRM: Xid \((?:PCI:)?(?P<pci>[^)\n]*)\): (?P<xid>" + str(code) + r"),"
    if 144 <= code <= 150:
        # "<unit> Fatal|Nonfatal XC0 i0 Link 13 (0x<IntrInfo> 0x<ErrorStatus> ...)"
        return head + (r"(?: (?P<unit>[A-Z0-9_/]+)[^\S\n]+(?P<fatality>Fatal|Nonfatal)[^\S\n]+XC\d i\d+ Link -?\d+"
                       r" \(0x(?P<intrinfo>[0-9a-fA-F]+) 0x(?P<status>[0-9a-fA-F]+))?")
    if code == 154:
        return head + (r" GPU recovery action changed from 0x[0-9a-fA-F]+ \([^)\n]*\)"
                       r" to 0x(?P<recovery>[0-9a-fA-F]+)")
    return head


def built_example(code: int, desc: str) -> str:
    if 144 <= code <= 150:
        return f"NVRM: Xid (PCI:0018:01:00): {code}, UNIT Nonfatal XC0 i0 Link 00 (0x00000000 0x00000000)"
    if code == 154:
        return (f"NVRM: Xid (PCI:0018:01:00): {code}, GPU recovery action changed"
                " from 0x0 (None) to 0x1 (GPU Reset Required)")
    return f"NVRM: Xid (PCI:0000:3b:00): {code}, pid=4242, name=python3, {desc}"


def decode_action(recovery: str, investigatory: str) -> str:
    action = DECODE_ACTIONS[recovery]
    if action == "none" and investigatory.strip() not in NOTHING_TO_INVESTIGATE:
        return "notify"
    return action


def decode_rows(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    by_unit: dict[str, list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        by_unit[r["unit"]].append(r)
    out: list[dict[str, Any]] = []
    for unit, group in by_unit.items():
        values = [int(v, 16) for r in group for v in r["error_status"].split("/") if v]
        # Sub-code values (0, or several bits) compare by equality; single bits by mask.
        equals = any(v == 0 or v & (v - 1) for v in values)
        for r in group:
            status = [v for v in r["error_status"].split("/") if v]
            sev = "critical" if r["severity"].lower().startswith(("fatal", "link fatal")) else "warning"
            base = {"unit": unit, "status": status, "match": "equals" if equals else "bits"}
            hw = {"hardware": h} if (h := DECODE_HARDWARE[r["hw_sw"]]) is not None else {}
            out.append({**base, "intrinfo": [r["intrinfo_v1_pre_r575"], r["intrinfo_v2_r575_plus"]],
                        "action": decode_action(r["recovery_action"], r["investigatory_action"]),
                        "severity": sev, **hw})
            if r["action2"]:
                out.append({**base, "intrinfo": [r["action2_intrinfo_v1"], r["action2_intrinfo_v2"]],
                            "action": decode_action(r["action2"], r["investigatory_action"]),
                            "severity": "critical", **hw})
    return out


def rule_for(
    row: dict[str, str], examples: dict[int, Any], decode: dict[int, list[dict[str, str]]],
) -> dict[str, Any]:
    code = int(row["code"])
    bucket = row["immediate_action"]
    action, hardware, severity = BUCKETS[bucket]
    desc = row["description"].split(" -- ")[0]
    rule: dict[str, Any] = {"id": f"xid-{code}"}
    text = f"Xid {code} {row['mnemonic']}: {desc} (catalog action {bucket or 'none given'}"
    text += f", investigate {row['investigatory_action']})" if row["investigatory_action"] else ")"
    if code in APP_SIDE:
        action, hardware, severity = "fix_application", "depends", "error"
        text += "; application-side unless the same GPU repeats"
    elif bucket == "RESTART_APP" and "CHECK_APP" in row["investigatory_action"]:
        action = "fix_application"
    if code == 64:
        text += "; with Xid 48 on the same GPU it is escalated by xid-48"
    if code in LOST:
        # The catalog's reboot (RESTART_BM) is followed by CONTACT_SUPPORT: the GPU is gone
        # until the node is serviced, so the job moves to a spare now.
        action = "replace_node"
        text += "; the job moves to a spare now (replace_node), the reboot and investigation follow"
    ex = examples.get(code)
    if ex:
        lines, refs = list(ex["lines"]), list(ex["refs"])
    else:
        lines, refs = [built_example(code, desc)], [CATALOG_URL]
        text += "; no public example line found, the example is built in the documented NVRM format"
    rule.update({
        "description": text, "sources": ["kernel"], "pattern": pattern(code),
        "fault_class": fault_class(code), "severity": severity, "hardware": hardware,
        "recommended_action": action,
    })
    if code in SYMPTOM_OF_OTHER_XID:
        rule["symptom_of"] = SYMPTOM_CLASSES
    if code in APP_SIDE:
        rule["escalation"] = {"count": 3, "window": 3600, "per": "gpu", "min_gap": 60,
                              "fault_class": "gpu_hardware", "recommended_action": "replace_node"}
    if code == 48:
        rule["escalation"] = {"count": 1, "window": 3600, "per": "gpu", "together_with": ["xid-63", "xid-64"],
                              "fault_class": "gpu_memory", "recommended_action": "replace_node"}
    if code == 154:
        rule["action_from"] = {"field": "recovery", "values": RECOVERY_ACTIONS}
    if code in decode:
        rule["decode"] = {"intrinfo_field": "intrinfo", "status_field": "status",
                          "rows": decode_rows(decode[code])}
    rule["fields"] = {"mnemonic": row["mnemonic"], "catalog_action": bucket or "none"}
    rule["examples"] = lines
    other = 79 if code != 79 else 13
    rule["counter_examples"] = [f"NVRM: Xid (PCI:0000:3b:00): {other}, pid=4242, name=python3, other error"]
    rule["references"] = [*refs, CATALOG_URL] if CATALOG_URL not in refs else refs
    return rule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    data = ROOT.parent / "shared" / "data"
    ap.add_argument("--catalog", type=Path, default=data / "nvidia-xid-catalog.csv")
    ap.add_argument("--decode", type=Path, default=data / "nvidia-xid-144-150-decode.csv")
    ap.add_argument("--examples", type=Path, default=Path(__file__).with_name("xid-examples.yaml"))
    ap.add_argument("--out", type=Path, default=ROOT / "rules" / "nvidia-xid.yaml")
    args = ap.parse_args()
    examples = yaml.safe_load(args.examples.read_text()) or {}
    decode: dict[int, list[dict[str, str]]] = defaultdict(list)
    with args.decode.open(newline="") as f:
        for r in csv.DictReader(f):
            decode[int(r["xid"])].append(r)
    with args.catalog.open(newline="") as f:
        rules = [rule_for(r, examples, decode) for r in csv.DictReader(f)]
    header = (
        "# Generated by rules/tools/gen_xid.py from NVIDIA's public Xid catalog; do not edit by hand.\n"
        "# One rule per Xid code. Buckets: RESTART_APP -> restart_job / fix_application, RESET_GPU ->\n"
        "# reset_gpu, RESTART_BM -> reboot_node, CONTACT_SUPPORT -> replace_node, IGNORE -> none.\n"
    )
    body = yaml.safe_dump({"pack": "nvidia-xid", "rules": rules}, sort_keys=False, width=200,
                          allow_unicode=True)
    args.out.write_text(header + body)
    print(f"wrote {len(rules)} rules to {args.out}")


if __name__ == "__main__":
    main()
