"""Every shipped rule pattern stays inside one line: no part of it can match a newline (checked on the parsed
pattern), and in a buffer of joined lines, made of its own examples cut at every position, no match of it
runs from one line into the next (checked with RE2 on the pattern as written, without the engine's guards)."""

from __future__ import annotations

import pytest
import re2

from analyzer.exact import can_span_lines
from analyzer.rules import Rule


def test_no_shipped_log_rule_pattern_can_match_a_newline(shipped_rules: list[Rule]) -> None:
    assert [r.id for r in shipped_rules if can_span_lines(r.pattern)] == []


@pytest.mark.parametrize(("pattern", "spans"), [
    (r"state [^ ]+ lost", True),
    (r"state [^ \n]+ lost", False),
    (r"foo\s+bar", True),
    (r"foo[^\S\n]+bar$", False),
    (r"foo.*bar", False),
    (r"(?s)foo.*bar", True),
    (r"foo\Dbar", True),
    (r"foo[\s,]bar", True),
])
def test_the_audit_tells_a_pattern_that_can_run_over_a_line_end(pattern: str, spans: bool) -> None:
    assert can_span_lines(pattern) is spans


def test_no_match_of_a_shipped_rule_runs_over_a_newline_in_joined_lines(shipped_rules: list[Rule]) -> None:
    opts = re2.Options()
    opts.log_errors = False
    spanning: list[str] = []
    for rule in shipped_rules:
        regex = re2.compile("(?m)" + rule.pattern, options=opts)
        for ex in rule.examples:
            # The example cut in two at every position: the two halves are adjacent lines of one buffer.
            buf = "\n".join(ex[:k] + "\n" + ex[k:] for k in range(1, len(ex)))
            if any("\n" in m.group(0) for m in regex.finditer(buf)):
                spanning.append(rule.id)
                break
    assert spanning == []
