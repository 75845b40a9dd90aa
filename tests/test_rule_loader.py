"""Rule loader: every shipped pack loads; a bad rule fails at load with its file, id and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.rules import RuleError, default_rules_dir, load_pack, load_rules

GOOD = """
rules:
  - id: demo-rule
    description: d
    sources: [kernel]
    pattern: 'NVRM: Xid \\(PCI:(?P<pci>[0-9a-f:]+)\\): 79,'
    fault_class: gpu_lost
    severity: critical
    hardware: true
    recommended_action: replace_node
    examples: ["NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"]
    references: ["https://github.com/NVIDIA/NVSentinel/issues/155"]
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pack.yaml"
    p.write_text(text)
    return p


def test_every_shipped_pack_loads() -> None:
    packs = sorted(default_rules_dir().glob("*.yaml"))
    assert packs
    rules = load_rules([default_rules_dir()])
    assert {r.pack for r in rules} == {p.stem for p in packs}
    for needed in ("xid-79", "xid-48", "xid-13", "nccl-watchdog-timeout", "cuda-oom"):
        assert needed in {r.id for r in rules}


def test_good_pack_loads(tmp_path: Path) -> None:
    [rule] = load_pack(_write(tmp_path, GOOD))
    assert rule.id == "demo-rule" and rule.sources == frozenset({"kernel"})


@pytest.mark.parametrize(("change", "field"), [
    (("fault_class: gpu_lost", "fault_class: gpu_melted"), "fault_class"),
    (("recommended_action: replace_node", "recommended_action: pray"), "recommended_action"),
    (('references: ["https://github.com/NVIDIA/NVSentinel/issues/155"]', "references: [somewhere]"), "references"),
    (('examples: ["NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"]', 'examples: ["nothing"]'),
     "examples[0]"),
    (("(?P<pci>[0-9a-f:]+)", "(?P<pci>[0-9a-f:]+"), "pattern"),
    (("(?P<pci>[0-9a-f:]+)", "(?P<pci>[0-9a-f:]+)(?=,)"), "pattern"),
    (("(?P<pci>[0-9a-f:]+)", "(?P<pci>[0-9a-f:]+)\\\\1"), "pattern"),
])
def test_bad_rule_fails_with_file_id_and_field(tmp_path: Path, change: tuple[str, str], field: str) -> None:
    path = _write(tmp_path, GOOD.replace(*change))
    with pytest.raises(RuleError) as err:
        load_pack(path)
    assert err.value.path == str(path) and err.value.rule_id == "demo-rule" and err.value.field == field
    assert str(path) in str(err.value) and "demo-rule" in str(err.value)


def test_duplicate_ids_across_packs_fail(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD)
    with pytest.raises(RuleError, match="duplicate"):
        load_rules([tmp_path])
