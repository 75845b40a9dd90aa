"""`kmend rules test LINE | --file F`: which rule matches each event, what it extracts, the finding.

Events are log lines, metric samples (Prometheus text as exporters print it, or JSON) and
Alertmanager webhook bodies; the kind is recognised from the text. Operators use it to
write their own packs: ``--rules`` / ``--metric-rules`` point at them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``rules`` subcommand."""
    p = sub.add_parser("rules", help="work with rule packs")
    rsub = p.add_subparsers(dest="rules_command", required=True)
    t = rsub.add_parser("test", help="show which rule matches each event and why",
                        description="Explain log lines, metric samples or Alertmanager alerts against the rules.")
    t.add_argument("line", nargs="?", help="one event: a log line, an exposition line or JSON")
    t.add_argument("--file", type=Path, help="events from a file (- for stdin); logs read as `kmend analyze` does")
    t.add_argument("--source", choices=["kernel", "container"], help="log source (default: rules of any source)")
    t.add_argument("--node", default="test-node", help="node name for events that name none")
    t.add_argument("--json", action="store_true", help="print JSON")
    t.add_argument("--rules", action="append", type=Path, metavar="PATH", help="log rule packs (default: shipped)")
    t.add_argument("--metric-rules", action="append", type=Path, metavar="PATH",
                   help="metric and alert rule packs (default: shipped)")
    t.set_defaults(func=run)


def _text(args: argparse.Namespace) -> str | None:
    if args.file is not None:
        return sys.stdin.read() if str(args.file) == "-" else args.file.read_text(encoding="utf-8", errors="replace")
    line: str | None = args.line
    return line


def run(args: argparse.Namespace) -> int:
    """Explain every event; exit 0, or 2 on bad input or a bad pack."""
    from analyzer.explain import RuleTester
    from analyzer.metric_rules import default_metric_rules_dir, load_signal_rules
    from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
    from analyzer.rules import RuleError, default_rules_dir, load_rules
    from kmend.rule_events import events_of

    if (args.line is None) == (args.file is None):
        print("kmend rules test: give a LINE or --file", file=sys.stderr)
        return 2
    try:
        text = _text(args)
        tester = RuleTester(load_rules(args.rules or [default_rules_dir()]),
                            progress_rules=load_progress_rules([default_progress_rules_dir()]),
                            signal_rules=load_signal_rules(args.metric_rules or [default_metric_rules_dir()]))
    except RuleError as exc:
        print(f"kmend rules test: bad rule pack: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kmend rules test: {exc}", file=sys.stderr)
        return 2
    assert text is not None
    try:
        signals = events_of(text, source=args.source, node=args.node)
    except ValueError as exc:
        print(f"kmend rules test: {exc}", file=sys.stderr)
        return 2
    results = [tester.explain(s, source_given=args.source is not None) for s in signals]
    if args.json:
        print(json.dumps({"events": results}, indent=2))
    else:
        print("\n".join(render(i, r) for i, r in enumerate(results, 1)))
    return 0


def _kv(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


def render(n: int, r: dict[str, Any]) -> str:
    """One event's explanation as text."""
    head = r["kind"] + (f" ({r['source']})" if r.get("source") else "")
    lines = [f"[{n}] {head}: {r['event'][:300]}"]
    for m in r["matches"]:
        f = m["finding"]
        lines.append(f"  matched {m['rule_id']}: {f['fault_class']} hardware={'yes' if f['hardware'] else 'no'} "
                     f"action={f['recommended_action']} severity={f['severity']}")
        if m["extracted"]:
            lines.append(f"    extracted: {_kv(m['extracted'])}")
        lines.append(f"    where: {_kv(f['where']) or '-'}")
    if not r["matches"]:
        lines.append("  no rule matched")
    for near in r.get("nearest", []):
        lines.append(f"    nearest {near['rule_id']} (score {near['score']}): e.g. {near['example'][:160]}")
    for pr in r.get("progress", []):
        lines.append(f"  progress {pr['rule_id']} ({pr['kind']}): {_kv(pr['extracted']) or 'matched'}")
    for note in r.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)
