"""The `kmend` command: the only entry point that imports the service."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kmend.commands import agent, analyze, demo, fluentbit, policy, serve


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="kmend", description="Diagnose and heal GPU training clusters")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (serve, agent, analyze, demo, fluentbit, policy):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code: int = args.func(args)
    except BrokenPipeError:
        # `kmend analyze ... | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
