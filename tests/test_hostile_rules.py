"""User rules cannot stall ingest: every match is confirmed and extracted by RE2 (linear time)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from analyzer.rules import RuleError, load_pack

EVIL = {
    "nested-plus": ("(?P<run>a+)+b", "a" * 27 + "!ab"),
    "overlapping-alternation": ("(?P<run>a|aa)+c", "a" * 37 + "!ac"),
}


def _pack(tmp_path: Path, rule_id: str, pattern: str, example: str) -> Path:
    d = tmp_path / "user-rules"
    d.mkdir(exist_ok=True)
    p = d / f"{rule_id}.yaml"
    p.write_text(textwrap.dedent(f"""
        rules:
          - id: {rule_id}
            description: a user rule whose pattern would backtrack exponentially in a backtracking engine
            sources: [container]
            pattern: '{pattern}'
            fault_class: app_error
            severity: error
            hardware: false
            recommended_action: notify
            examples: ["{example}"]
            references: ["https://github.com/google/re2/wiki/WhyRE2"]
    """))
    return d


# Runs in a child process so a backtracking engine that stalls is stopped by the timeout, not the suite.
_SCAN = """
import json, sys, time
from pathlib import Path
from analyzer.engine import Backend, available_backends
from analyzer.pipeline import Analyzer
from analyzer.rules import default_rules_dir, load_rules
from collector.prefilter import RegexPrefilter
from collector.signal import LogLine, Signal, Source
rules = load_rules([default_rules_dir(), Path(sys.argv[1])])
line = sys.argv[2]
xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
out = {}
for be in available_backends():
    an = Analyzer(rules, backend=Backend(be))
    sigs = [Signal(f"{be}-{i}", "gpu-node-01", Source.KERNEL if t is xid else Source.CONTAINER, 100.0 + i,
                   LogLine(t)) for i, t in enumerate([xid, line, xid])]
    t = time.perf_counter()
    found = an.matcher.match(sigs)
    out[be] = [time.perf_counter() - t, sorted({f.rule_id for f in found}), [f.fields.get("run") for f in found
                                                                               if f.rule_id.startswith("user")]]
pf = RegexPrefilter([r.pattern for r in rules], use_hyperscan=False)
t = time.perf_counter()
out["prefilter"] = [time.perf_counter() - t if pf.matches(line) else -1.0]
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", sorted(EVIL))
def test_a_catastrophic_user_pattern_costs_microseconds_on_a_short_line(tmp_path: Path, name: str) -> None:
    pattern, line = EVIL[name]
    assert len(line) <= 40
    rules_dir = _pack(tmp_path, f"user-{name}", pattern, line)
    proc = subprocess.run([sys.executable, "-c", _SCAN, str(rules_dir), line], capture_output=True, text=True,
                          timeout=20, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for backend, (seconds, rule_ids, runs) in ((k, v) for k, v in out.items() if k != "prefilter"):
        # The line before and the line after the hostile one are still found, and the hostile one too.
        assert rule_ids == sorted({"xid-79", f"user-{name}"}), backend
        assert runs == ["a"], backend
        assert seconds < 0.5, (backend, seconds)
    assert 0 <= out["prefilter"][0] < 0.5


def test_a_stalling_scan_would_be_seen_by_this_test(tmp_path: Path) -> None:
    # The guard above measures real time in a child: a backtracking `re` over the same line takes seconds.
    code = "import re, time; t = time.perf_counter(); re.search(r'(a+)+b', 'a' * 22 + '!ab'); " \
           "print(time.perf_counter() - t)"
    seconds = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   timeout=60).stdout)
    assert seconds > 0.01


@pytest.mark.parametrize(("pattern", "why"), [
    (r"(?P<x>a)(?P=x)", "backtracking"),
    (r"(?<=GPU )lost", "backtracking"),
    (r"Xid{1001}", "RE2"),
    (r"fallen off\Z", "RE2"),
])
def test_patterns_re2_cannot_run_are_refused_at_load_with_file_rule_and_field(
        tmp_path: Path, pattern: str, why: str) -> None:
    d = _pack(tmp_path, "user-refused", pattern, "GPU lost")
    path = d / "user-refused.yaml"
    with pytest.raises(RuleError) as err:
        load_pack(path)
    assert (err.value.path, err.value.rule_id, err.value.field) == (str(path), "user-refused", "pattern")
    assert why in str(err.value)
