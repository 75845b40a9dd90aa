"""Rule loading and the multi-pattern engine: refused patterns, bad rules named by file/id/field,
batch and byte-buffer scanning, and the in-message actions (Xid 154, NVLink5 register decode)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from analyzer.engine import Backend, MultiMatcher, available_backends
from analyzer.pipeline import Analyzer
from analyzer.records import Action, Severity
from analyzer.rules import Rule, RuleError, default_rules_dir, load_pack, load_rules
from collector.signal import LogLine, Signal, Source

GOOD = """\
  - id: {id}
    description: test rule
    sources: [container]
    pattern: '{pattern}'
    fault_class: app_error
    severity: error
    hardware: false
    recommended_action: fix_application
    examples: ['{example}']
    references: [https://example.org/issue/1]
"""


def pack(tmp_path: Path, *rules: str) -> Path:
    p = tmp_path / "test-pack.yaml"
    p.write_text("rules:\n" + "".join(rules))
    return p


@pytest.mark.parametrize("pattern", [r"(a+)\1", r"foo(?=bar)", r"(?<!x)foo", r"a++b", r"(?>ab)c"])
def test_patterns_that_need_backtracking_are_refused(tmp_path: Path, pattern: str) -> None:
    p = pack(tmp_path, GOOD.format(id="slow", pattern=pattern, example="aa foobar"))
    with pytest.raises(RuleError) as err:
        load_pack(p)
    assert (err.value.path, err.value.rule_id, err.value.field) == (str(p), "slow", "pattern")
    assert "linear-time" in str(err.value)


def test_a_bad_rule_fails_with_file_id_and_field(tmp_path: Path) -> None:
    bad = GOOD.format(id="bad-one", pattern="boom", example="boom").replace("app_error", "gpu_on_fire")
    p = pack(tmp_path, GOOD.format(id="fine", pattern="ok", example="ok"), bad)
    with pytest.raises(RuleError) as err:
        load_pack(p)
    assert (err.value.rule_id, err.value.field) == ("bad-one", "fault_class")
    assert str(p) in str(err.value)


def test_an_example_that_does_not_match_is_reported(tmp_path: Path) -> None:
    p = pack(tmp_path, GOOD.format(id="r1", pattern="needle", example="haystack"))
    with pytest.raises(RuleError) as err:
        load_pack(p)
    assert err.value.field == "examples[0]"


def test_a_pattern_matching_the_empty_string_is_refused(tmp_path: Path) -> None:
    p = pack(tmp_path, GOOD.format(id="empty", pattern="x*", example="x"))
    with pytest.raises(RuleError, match="empty string"):
        load_pack(p)


def test_escalation_companion_must_exist(tmp_path: Path) -> None:
    rule = GOOD.format(id="r1", pattern="boom", example="boom") + textwrap.indent(
        "escalation: {window: 60, together_with: [no-such-rule]}\n", "    ")
    with pytest.raises(RuleError) as err:
        load_rules([pack(tmp_path, rule)])
    assert err.value.field == "escalation.together_with"


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


@pytest.mark.parametrize("backend", available_backends(), ids=str)
def test_buffer_scan_finds_lines_by_byte_offset(rules: list[Rule], backend: Backend) -> None:
    lines = ["noise é ü", "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus", "more noise",
             "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered"]
    data = "\n".join(lines).encode()
    hits = MultiMatcher(rules, backend=backend).scan_buffer(data)
    assert [(h.rule.id, data[h.start:h.end].decode()) for h in hits] == [
        ("xid-79", lines[1]), ("cuda-illegal-memory-access", lines[3])]


def test_embedded_newlines_do_not_shift_lines(rules: list[Rule]) -> None:
    lines = ["a\nb", "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"]
    [hit] = MultiMatcher(rules).scan(lines)
    assert (hit.line, hit.rule.id) == (1, "xid-79")


def _kernel(node: str, text: str, ts: float = 100.0, n: int = 0) -> Signal:
    return Signal(id=f"{node}:k:{n}", node=node, source=Source.KERNEL, ts=ts, payload=LogLine(text=text))


@pytest.mark.parametrize(("code", "action"), [("0x1 (GPU Reset Required)", Action.RESET_GPU),
                                              ("0x2 (Node Reboot Required)", Action.REBOOT_NODE),
                                              ("0x4 (Drain and Reset)", Action.REPLACE_NODE),
                                              ("0x0 (None)", Action.NONE)])
def test_xid154_carries_its_own_recovery_action(rules: list[Rule], code: str, action: Action) -> None:
    line = f"NVRM: Xid (PCI:0000:3e:00): 154, GPU recovery action changed from 0x0 (None) to {code}"
    [f] = Analyzer(rules).findings([_kernel("n1", line)])
    assert f.rule_id == "xid-154" and f.recommended_action is action


def test_nvlink5_xid_is_decoded_from_its_registers(rules: list[Rule]) -> None:
    fatal = ("NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 "
             "(0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)")
    benign = ("NVRM: Xid (PCI:0000:01:00): 144, SAW_MVB Nonfatal XC0 i0 Link 0 "
              "(0x00000001 0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)")
    # Status bit 0x04 of SAW_MVB: ignore, and nothing to investigate.
    ignored = ("NVRM: Xid (PCI:0000:01:00): 144, SAW_MVB Nonfatal XC0 i0 Link 0 "
               "(0x00000001 0x00000004 0x00000000 0x00000000 0x00000000 0x00000000)")
    f1, f2, f3 = Analyzer(rules).findings([_kernel("n1", fatal), _kernel("n1", benign, n=1),
                                           _kernel("n1", ignored, n=2)])
    assert (f1.recommended_action, f1.severity) == (Action.RESET_GPU, Severity.CRITICAL)
    assert f1.fields["decoded_unit"] == "NETIR_LINK_EVT/NETIR_LINK_DOWN"
    # Bit 0x08: no reset, but the table asks for an investigation, so the operator is told.
    assert (f2.recommended_action, f2.severity) == (Action.NOTIFY, Severity.WARNING)
    assert (f3.recommended_action, f3.severity) == (Action.NONE, Severity.WARNING)
