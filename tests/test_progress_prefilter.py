"""The progress rules' combined prefilter gives the rule-by-rule answer on every line: each shipped progress
rule's examples and counter-examples, bar redraws, rank prefixes, the log corpus and noise lines."""

from __future__ import annotations

import random

import yaml

from analyzer.progress import ProgressMatcher, match_progress
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from tests.conftest import REPO


def _lines() -> list[str]:
    out: list[str] = []
    for pack in sorted(default_progress_rules_dir().glob("*.yaml")):
        for rule in yaml.safe_load(pack.read_text())["rules"]:
            out.extend(ex["line"] for ex in rule["examples"])
            out.extend(rule.get("counter_examples", ()))
    for family in sorted((REPO / "tests" / "corpus").glob("*.yaml")):
        for entry in yaml.safe_load(family.read_text())["entries"]:
            out.extend(entry["text"].splitlines())
    return out


def test_the_prefilter_gives_every_lines_rule_and_values() -> None:
    rules = load_progress_rules([default_progress_rules_dir()])
    ordered = sorted(rules, key=lambda r: r.priority)
    matcher = ProgressMatcher(rules)
    rng = random.Random(5)
    base = _lines()
    lines = base + [f"[rank{rng.randrange(64)}]: {ln}" for ln in rng.sample(base, 300)]
    lines += ["\r".join(rng.sample(base, 3)) for _ in range(300)]  # a bar redrawn within one line
    lines += ["", "\r", "step", "iter ", "<", "Epoch 3: 100%|", "global_step=12 loss=1.0 tps: 4"]
    want = [match_progress(ln, ordered) for ln in lines]
    got = [matcher.match(ln) for ln in lines]
    assert [(w[0].id, w[1]) if w else None for w in want] == [(g[0].id, g[1]) if g else None for g in got]
    assert sum(w is not None for w in want) > 50
    assert len({w[0].id for w in want if w}) == len(rules)  # every rule answered somewhere


def test_no_rules_match_nothing() -> None:
    assert ProgressMatcher([]).match("step 3/10 loss 1.0") is None
