"""`kmend eval corpus`: run every real-log excerpt through the `kmend analyze` path and score it.

Each excerpt is written as the file a bundle would hold for its source (a kernel log,
a pod's container log under ``/var/log/pods``, or a file of unknown kind), diagnosed by
the same code as ``kmend analyze`` with the rules compiled once, and judged by its top
incident. The figures are printed per half (``dev``, ``heldout``) and for both.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from analyzer.corpus import CorpusEntry, CorpusError, Outcome, check_unique, outcome, parse_entries, score
from analyzer.matcher import FastMatcher
from analyzer.metric_rules import default_metric_rules_dir, load_signal_rules
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.rules import RuleError, default_rules_dir, load_rules
from collector.bundle import BundleSource
from kmend.bundle_analysis import diagnose_source

_KERNEL_SOURCES = frozenset({"kernel", "syslog", "journal", "kmsg", "dmesg"})
_CONTAINER_SOURCES = frozenset({"container"})


def _load_yaml(text: str) -> object:
    """libyaml's safe loader where PyYAML has it (about ten times faster), else PyYAML's own, which also reads what
    libyaml refuses (a tab at the start of a block scalar's line, as pasted logs hold)."""
    fast = getattr(yaml, "CSafeLoader", None)
    if fast is not None:
        try:
            return yaml.load(text, Loader=fast)
        except yaml.YAMLError:
            pass
    return yaml.safe_load(text)


def load_corpus(directory: Path) -> list[CorpusEntry]:
    """Every entry of every ``*.yaml`` file in the directory; CorpusError on a bad one."""
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise CorpusError(f"{directory}: no corpus files (*.yaml)")
    entries: list[CorpusEntry] = []
    for f in files:
        try:
            doc = _load_yaml(f.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise CorpusError(f"{f}: {exc}") from exc
        entries.extend(parse_entries(doc, str(f)))
    check_unique(entries)
    return entries


def bundle_path(root: Path, source: str) -> Path:
    """Where a bundle would hold lines arriving from `source` (the path decides the log kind)."""
    if source in _KERNEL_SOURCES:
        return root / "node-0" / "var" / "log" / "kern.log"
    if source in _CONTAINER_SOURCES:
        return root / "node-0" / "var" / "log" / "pods" / "train_job-worker-0_0123abcd-0000" / "trainer" / "0.log"
    return root / "node-0" / f"{source}.txt"


def run_entries(entries: Sequence[CorpusEntry], rules_dirs: Sequence[Path]) -> list[Outcome]:
    """Diagnose each excerpt as its own bundle and judge the incidents."""
    rules = load_rules(list(rules_dirs))
    matcher = FastMatcher(rules)
    progress_rules = load_progress_rules([default_progress_rules_dir()])
    signal_rules = load_signal_rules([default_metric_rules_dir()])
    out: list[Outcome] = []
    # One bundle directory for every excerpt, each excerpt's file removed after it is read: a directory tree per
    # excerpt made the clean-up of the temporary tree (some 8,000 directories) take longer than the diagnosis.
    with tempfile.TemporaryDirectory(prefix="kmend-corpus-") as tmp:
        root = Path(tmp)
        for entry in entries:
            path = bundle_path(root, entry.source)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(entry.text, encoding="utf-8")
            try:
                incidents = diagnose_source(BundleSource([str(root)]), rules, matcher, progress_rules,
                                            signal_rules=signal_rules)
            finally:
                path.unlink()
            out.append(outcome(entry, incidents))
    return out


def report(outcomes: Sequence[Outcome], split: str, misses: str = "dev") -> dict[str, Any]:
    """Scores per half; `split` picks which halves (``all`` gives both and the total).

    `misses` says whose misses are listed (``dev``, ``all`` or ``none``): rules are written from
    the development half only, so by default nobody reads which held-out excerpts failed.
    """
    halves = ("dev", "heldout") if split == "all" else (split,)
    result: dict[str, Any] = {}
    for half in halves:
        result[half] = score([o for o in outcomes if o.entry.split == half])
        if misses == "none" or (misses == "dev" and half != "dev"):
            result[half]["misses"] = f"{len(result[half]['misses'])} (listed with --misses all)"
    if split == "all":
        result["all"] = {k: v for k, v in score(outcomes).items() if k != "misses"}
    return result


def render_text(result: dict[str, Any]) -> str:
    """The figures as a short table, then the misses."""
    keys = ("excerpts", "faults", "benign", "class_accuracy", "hardware_accuracy", "action_accuracy",
            "no_incident", "benign_alarms", "app_quarantines")
    names = list(result)
    width = max(len(k) for k in keys)
    lines = [" " * width + "  " + "  ".join(f"{n:>8}" for n in names)]
    for k in keys:
        lines.append(f"{k:<{width}}  " + "  ".join(f"{_cell(result[n].get(k)):>8}" for n in names))
    classes = sorted({c for n in names for c in result[n].get("by_class", {})})
    if classes:
        lines += ["", "by class: right class / faults (no incident) hw right call / labelled"]
        for c in classes:
            cells = []
            for n in names:
                row = result[n].get("by_class", {}).get(c)
                cells.append(f"{row['class_ok']}/{row['faults']} ({row['no_incident']}) hw "
                             f"{row['hardware_ok']}/{row['hardware_labelled']}" if row else "-")
            lines.append(f"{c:<{width}}  " + "  ".join(f"{cell:>22}" for cell in cells))
    for n in names:
        listed = result[n].get("misses", [])
        if isinstance(listed, str):
            lines.append(f"{n} misses: {listed}")
            continue
        for m in listed:
            exp, got = m["expected"], m["got"]
            lines.append(f"{n} miss {m['id']}: expected {exp['fault_class']}/hw={exp['hardware']}/"
                         f"{','.join(exp['actions'])} got {got['fault_class']}/hw={got['hardware']}/"
                         f"{got['action']} ({got['rule']})")
    return "\n".join(lines)


def _cell(v: object) -> str:
    return "-" if v is None else str(v)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kmend eval corpus``; exit code 0, or 2 on a bad corpus or rule pack."""
    try:
        entries = load_corpus(args.dir)
        outcomes = run_entries(entries, args.rules or [default_rules_dir()])
    except (CorpusError, RuleError, OSError) as exc:
        print(f"kmend eval corpus: {exc}", file=sys.stderr)
        return 2
    result = report(outcomes, args.split, args.misses)
    print(json.dumps(result, indent=2) if args.format == "json" else render_text(result))
    return 0
