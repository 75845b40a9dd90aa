"""`kmend eval corpus`: score the rule packs on the real-log corpus (logic in kmend.corpus_eval)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``eval`` subcommand (with its ``corpus`` target) to an argparse subparsers object."""
    p = subparsers.add_parser("eval", help="score the diagnosis on labelled real logs",
                              description="Score kmend's diagnosis on labelled excerpts of real logs.")
    targets = p.add_subparsers(dest="target", required=True)
    c = targets.add_parser("corpus", help="the real-log corpus (tests/corpus/*.yaml)",
                           description="Run each corpus excerpt through the kmend analyze path and score "
                                       "fault class, hardware/application call, action and benign alarms per half.")
    c.add_argument("--dir", type=Path, default=Path("tests/corpus"), help="corpus directory (default: tests/corpus)")
    c.add_argument("--split", choices=["dev", "heldout", "all"], default="all", help="which half to score")
    c.add_argument("--misses", choices=["dev", "all", "none"], default="dev",
                   help="whose misses to list (default: dev; rules are written from the dev half only)")
    c.add_argument("--format", choices=["table", "json"], default="table", help="output format")
    c.add_argument("--rules", action="append", type=Path, metavar="PATH",
                   help="rule pack file or directory (repeatable; default: the shipped packs)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Score the corpus; exit code 0, or 2 on a bad corpus or rule pack."""
    # Imported here: the rule engine and the detectors are not for `kmend agent`.
    from kmend.corpus_eval import run as evaluate

    return evaluate(args)
