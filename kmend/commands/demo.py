"""`kmend demo`."""

from __future__ import annotations

import argparse
import json
import sys

from kmend.errors import ConfigError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    p = sub.add_parser("demo", help="simulated cluster + training job + injected Xid 79, detected and healed")
    p.add_argument("--json", action="store_true", help="print one JSON summary object and nothing else")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--job-nodes", type=int, default=8)
    p.set_defaults(func=run)


SPARES = 2
"""Hot spares the demo's cluster keeps (the nodes after the job's)."""


def check_sizes(nodes: int, gpus: int, job_nodes: int) -> str:
    """Why these sizes make no demo (empty when they do)."""
    if gpus < 1 or job_nodes < 1:
        return "--gpus and --job-nodes must be at least 1"
    if nodes < job_nodes + SPARES:
        return (f"--nodes {nodes} leaves no room for a {job_nodes}-node job and {SPARES} hot spares: "
                f"use --nodes {job_nodes + SPARES} or more")
    if nodes > 4096:
        return "--nodes is at most 4096"
    return ""


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 only if the fault was healed."""
    if why := check_sizes(args.nodes, args.gpus, args.job_nodes):
        raise ConfigError(why)
    # Imported here so that `kmend agent` on every node does not load the web stack.
    from kmend.demo import print_human, run_demo

    def quiet(_: str) -> None:
        return None

    say = quiet if args.json else print
    summary = run_demo(nodes=args.nodes, gpus=args.gpus, job_nodes=args.job_nodes, spares=SPARES,
                       fault_node=min(5, args.job_nodes - 1), fault_gpu=min(3, args.gpus - 1), say=say)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_human(summary)
    return 0 if summary["healed"] else 1
