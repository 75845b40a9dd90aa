"""Diagnosis quality on the real-log corpus: one JSON object per half, then the total.

    python bench/corpus.py                      # the shipped packs over tests/corpus
    python bench/corpus.py --rules /tmp/old/rules --dir tests/corpus

Each object carries the half (``dev``, ``heldout``, ``all``), the excerpt counts and the
fault-class, hardware/application and action accuracies, benign alarms and quarantines of a
node for an application fault, as ``kmend eval corpus --format json`` computes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.rules import default_rules_dir
from kmend.corpus_eval import load_corpus, report, run_entries

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=REPO / "tests" / "corpus")
    parser.add_argument("--rules", type=Path, action="append", help="rule pack file or directory (repeatable)")
    args = parser.parse_args()
    started = time.perf_counter()
    outcomes = run_entries(load_corpus(args.dir), args.rules or [default_rules_dir()])
    elapsed = time.perf_counter() - started
    result = report(outcomes, "all")
    for half, figures in result.items():
        figures = {k: v for k, v in figures.items() if k != "misses"}
        print(json.dumps({"bench": "corpus", "half": half, **figures, "seconds": round(elapsed, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
