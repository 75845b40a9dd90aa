"""Progress extraction offers a line only the rules whose literal it holds: same events as trying every rule, a
fraction of the regex work (the shipped rules' own examples and a Megatron batch as the service receives it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import yaml

from analyzer.progress import ProgressExtractor, match_progress
from analyzer.progress_rules import ProgressRule, default_progress_rules_dir, load_progress_rules
from tests.builders import container


@pytest.fixture(scope="module")
def rules() -> list[ProgressRule]:
    return load_progress_rules([default_progress_rules_dir()])


def _shipped_lines() -> list[str]:
    """Every example and counter-example line of the shipped progress packs."""
    out: list[str] = []
    for path in sorted(default_progress_rules_dir().glob("*.yaml")):
        for rule in yaml.safe_load(path.read_text())["rules"]:
            out += [ex["line"] for ex in rule["examples"]] + list(rule.get("counter_examples", ()))
    return out


def _reference(rules: Sequence[ProgressRule], sigs: Sequence[Any]) -> list[tuple[str, str, float | None]]:
    """Every rule tried on every line, in priority order (what the extractor did before the filter)."""
    ordered = sorted(rules, key=lambda r: r.priority)
    out = []
    for s in sigs:
        found = match_progress(s.payload.text, ordered)
        if found is not None:
            out.append((s.id, found[0].id, found[1].step_time))
    return out


def test_same_rule_and_values_as_trying_every_rule(rules: list[ProgressRule]) -> None:
    lines = _shipped_lines()
    # Also prefixed, redrawn with carriage returns, and folded with a newline: the shapes the agent ships.
    lines += [f"[rank3]: {t}" for t in lines[:40]]
    lines += [f"{a}\r{b}" for a, b in zip(lines[::7], lines[3::7], strict=False)]
    lines += [f"{a}\n{b}" for a, b in zip(lines[::11], lines[5::11], strict=False)]
    sigs = [container("n1", t, job="j", rank=0, ts=1000.0 + i) for i, t in enumerate(lines)]
    want = _reference(rules, sigs)
    got = ProgressExtractor(rules).extract(sigs)
    assert len(want) > 100
    assert [(e.signal_id, e.rule_id, e.step_time) for e in got] == want


_tried = [0]


@dataclasses.dataclass(frozen=True)
class _CountingRule(ProgressRule):
    """A shipped rule that counts how often it is tried."""

    def extract(self, text: str) -> Any:
        _tried[0] += 1
        return ProgressRule.extract(self, text)


def test_a_line_is_offered_only_the_rules_whose_literal_it_holds(rules: list[ProgressRule]) -> None:
    counted = [_CountingRule(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.init}) for r in rules]
    sigs = [container("n1", f"[rank{i % 8}]:  iteration {i:8d}/  500000 | consumed samples: {i * 1024:12d} | "
                      f"elapsed time per iteration (ms): 850.{i % 10} | learning rate: 3.000E-04 | global batch "
                      f"size:  1024 | lm loss: 2.1E+00 | loss scale: 1.0 | grad norm: 0.31 |", job="j", rank=i % 8,
                      ts=1000.0 + i) for i in range(1, 1001)]
    sigs += [container("n1", f"[rank{i % 8}]: data loader: epoch 3, shard {i} of 2048", job="j", rank=i % 8,
                       ts=3000.0 + i) for i in range(1000)]
    _tried[0] = 0
    events = ProgressExtractor(counted).extract(sigs)
    assert [e.step for e in events] == list(range(1, 1001))
    # Trying each of the ~20 rules on each line was a Python call per rule and line (40,000 here): the
    # step lines now try the two or three rules whose literal they hold, the loader lines none.
    assert len(rules) >= 15
    assert _tried[0] <= 3 * 1000, _tried[0]


def test_ascii_lines_read_through_bytes_give_what_the_text_search_gives(rules: list[ProgressRule]) -> None:
    lines = _shipped_lines()
    lines += [t + " \u2014 \u00e9t\u00e9" for t in lines[:30]]  # not ASCII: the text path
    compared = 0
    for rule in rules:
        assert rule.ascii_search is not None
        for text in lines:
            if rule.contains not in text:
                continue
            m = rule.regex.search(text)
            want = None if m is None else m.groupdict()
            got = rule.ascii_search.groups(text.encode()) if text.isascii() else want
            assert got == want, (rule.id, text)
            compared += text.isascii()
            ext = rule.extract(text)
            assert (ext is None) == (m is None), (rule.id, text)
    assert compared > 100
