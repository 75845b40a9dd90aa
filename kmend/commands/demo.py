"""`kmend demo`."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    p = sub.add_parser("demo", help="simulated cluster + training job + injected Xid 79, detected and healed")
    p.add_argument("--json", action="store_true", help="print one JSON summary object and nothing else")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--job-nodes", type=int, default=8)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 only if the fault was healed."""
    # Imported here so that `kmend agent` on every node does not load the web stack.
    from kmend.demo import print_human, run_demo

    def quiet(_: str) -> None:
        return None

    say = quiet if args.json else print
    summary = run_demo(nodes=args.nodes, gpus=args.gpus, job_nodes=args.job_nodes, say=say)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_human(summary)
    return 0 if summary["healed"] else 1
