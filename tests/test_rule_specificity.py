"""A specific rule beats a generic catch-all on the same event, whatever the load order (bundle and service paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from analyzer.pipeline import Analyzer
from analyzer.records import FaultClass
from analyzer.rules import Rule, RuleError, load_pack
from collector.signal import LogLine, Signal, Source
from tests.analyze_helpers import analyze_cli

CORPUS = Path(__file__).parent / "corpus"


def _excerpt(family: str, entry_id: str) -> str:
    entries = yaml.safe_load((CORPUS / f"{family}.yaml").read_text())["entries"]
    [entry] = [e for e in entries if e["id"] == entry_id]
    text: str = entry["text"]
    return text


# vllm#2418 (development half): vLLM's KV-cache limit raised as a ValueError.
VLLM_2418 = _excerpt("round13-host-app", "vllm-2418-max-seq-len-exceeds-kv-cache")
KV_LINE = next(line for line in VLLM_2418.splitlines() if line.startswith("ValueError:"))


def test_vllm_kv_cache_valueerror_is_diagnosed_as_gpu_memory_not_a_bug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    incidents: list[Any] = analyze_cli(tmp_path, capsys, VLLM_2418)
    [incident] = incidents
    assert incident["fault_class"] == "oom_gpu"
    assert incident["hardware"] is False
    assert [f["rule_id"] for f in incident["findings"]] == ["vllm-max-len-exceeds-kv-cache"]


def _signal(text: str) -> Signal:
    return Signal("pod/1", "node-a", Source.CONTAINER, 1_700_000_000.0, LogLine(text, job="serve"))


@pytest.mark.parametrize("reverse", [False, True], ids=["load-order", "reversed"])
@pytest.mark.parametrize("one_per_signal", [True, False], ids=["bundle", "service"])
def test_the_specific_rule_wins_in_either_load_order(
    shipped_rules: list[Rule], reverse: bool, one_per_signal: bool,
) -> None:
    rules = list(reversed(shipped_rules)) if reverse else shipped_rules
    analyzer = Analyzer(rules, one_finding_per_signal=one_per_signal)
    found, incidents = analyzer.process([_signal(KV_LINE)])
    assert [f.rule_id for f in found] == ["vllm-max-len-exceeds-kv-cache"]
    assert [i.fault_class for i in incidents] == [FaultClass.OOM_GPU]


def test_a_generic_rule_still_diagnoses_what_no_specific_rule_matches(shipped_rules: list[Rule]) -> None:
    line = "ValueError: invalid literal for int() with base 10: '--work-dir'"
    found, incidents = Analyzer(shipped_rules).process([_signal(line)])
    assert [f.rule_id for f in found] == ["python-exception"]
    assert [i.fault_class for i in incidents] == [FaultClass.APP_ERROR]


def test_generic_is_read_from_the_pack_and_defaults_to_specific(tmp_path: Path) -> None:
    pack = tmp_path / "p.yaml"
    rule = {"description": "d", "sources": ["container"], "fault_class": "app_error", "severity": "error",
            "hardware": False, "recommended_action": "fix_application", "references": ["https://example.org/x"]}
    pack.write_text(yaml.safe_dump({"rules": [
        {"id": "any-error", "pattern": "Error: ", "generic": True, "examples": ["Error: x"], **rule},
        {"id": "some-error", "pattern": "Error: x", "examples": ["Error: x"], **rule},
    ]}))
    by_id = {r.id: r for r in load_pack(pack)}
    assert by_id["any-error"].generic and not by_id["some-error"].generic
    pack.write_text(pack.read_text().replace("generic: true", "generic: maybe"))
    with pytest.raises(RuleError, match="generic"):
        load_pack(pack)
