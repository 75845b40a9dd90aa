"""`kmend analyze PATH...`: offline diagnosis of a log bundle (logic in kmend.bundle_analysis)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``analyze`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "analyze", help="diagnose a log bundle offline",
        description="Diagnose GPU-cluster faults in log files, directories or stdin (-).",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="file, directory or - for stdin")
    p.add_argument("--format", choices=["table", "json"], default="table", help="output format")
    p.add_argument("--node", help="node name for files whose path does not say")
    p.add_argument("--job", help="job name (default: derived from the pod name)")
    p.add_argument("--pod-labels-file", type=Path, metavar="PATH",
                   help="JSON/YAML mapping 'namespace/pod' to labels (job and rank, as `kmend agent` reads it)")
    p.add_argument("--rules", action="append", type=Path, metavar="PATH",
                   help="rule pack file or directory (repeatable; default: the shipped packs)")
    p.add_argument("--window", type=float, default=None, metavar="SECONDS",
                   help="how far apart a cause and its symptoms may be (default: the whole bundle)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Diagnose the bundle; exit code 0, or 2 on a bad rule pack or unreadable input."""
    # Imported here: the rule engine and the detectors (scikit-learn) are not for `kmend agent`.
    from kmend.bundle_analysis import run as analyze

    return analyze(args)
