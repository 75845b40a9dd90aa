"""Progress-rule matching cost per line: every rule tried on every line, against one combined prefilter.

    python bench/progress_rules.py                 # 200,000 lines, prints one JSON object per matcher
    python bench/progress_rules.py --lines 50000

The mix is bench/rules.py's (training stdout, NCCL INFO chatter, kernel noise) with the progress packs'
own example lines mixed in. Both matchers run in the same process, in interleaved rounds, timed in CPU
seconds of this process; the fastest round of each counts, and ``ratio_to_rule_by_rule`` is the speed-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.progress import ProgressMatcher, match_progress
from analyzer.progress_rules import ProgressRule, default_progress_rules_dir, load_progress_rules
from analyzer.rules import default_rules_dir, load_rules
from bench.rules import generate


def progress_examples() -> list[str]:
    """The shipped progress packs' example lines."""
    out: list[str] = []
    for pack in sorted(default_progress_rules_dir().glob("*.yaml")):
        for rule in yaml.safe_load(pack.read_text())["rules"]:
            out.extend(ex["line"] for ex in rule["examples"])
    return out


def timed(match: Callable[[str], object], lines: Sequence[str]) -> tuple[float, int]:
    """CPU seconds to match every line, and how many lines gave progress."""
    t0 = time.process_time()
    found = sum(1 for ln in lines if match(ln) is not None)
    return time.process_time() - t0, found


def main() -> int:
    ap = argparse.ArgumentParser(description="progress-rule matching cost per line")
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--progress-share", type=float, default=0.05, help="share of lines from the progress packs")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    rules: list[ProgressRule] = load_progress_rules([default_progress_rules_dir()])
    rng = random.Random(3)
    mix, _ = generate(load_rules([default_rules_dir()]), args.lines * 110)
    examples = progress_examples()
    lines = [rng.choice(examples) if rng.random() < args.progress_share else ln for ln in mix[:args.lines]]
    ordered = sorted(rules, key=lambda r: r.priority)
    matchers: dict[str, Callable[[str], object]] = {
        "rule by rule (literal, then pattern)": lambda ln: match_progress(ln, ordered),
        "combined prefilter (RE2 set)": ProgressMatcher(rules).match,
    }
    best: dict[str, tuple[float, int]] = {}
    for _ in range(max(args.repeat, 1)):
        for name, match in matchers.items():
            cpu, found = timed(match, lines)
            if name not in best or cpu < best[name][0]:
                best[name] = (cpu, found)
    floor = best["rule by rule (literal, then pattern)"][0]
    for name, (cpu, found) in best.items():
        print(json.dumps({"bench": "progress_rules", "matcher": name, "rules": len(rules), "lines": len(lines),
                          "progress_lines": found, "cpu_seconds": round(cpu, 4),
                          "us_per_line": round(cpu / len(lines) * 1e6, 3),
                          "ratio_to_rule_by_rule": round(floor / cpu, 2), "repeat": args.repeat,
                          "statistic": "fastest", "python": platform.python_version()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
