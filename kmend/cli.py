"""The `kmend` command: the only entry point that imports the service."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from kmend.errors import EXIT_CONFIG, ConfigError

COMMANDS = ("serve", "agent", "analyze", "demo", "fluentbit", "rules", "evaluate", "policy", "ctl")
"""The modules under kmend.commands, in the order `kmend --help` lists them (each registers its subcommands)."""
NAMES = {"serve": "serve", "agent": "agent", "analyze": "analyze", "demo": "demo", "fluentbit-config": "fluentbit",
         "rules": "rules", "eval": "evaluate", "policy": "policy"}
"""The module that registers a subcommand, by the name a user types; any other word (ctl's verbs, help, a typo)
registers every module."""

# Installed by the `service` extra only: the agent image and `pip install kmend` leave them out.
SERVICE_ONLY = frozenset({"fastapi", "uvicorn", "starlette", "sqlalchemy", "alembic", "psycopg", "kubernetes",
                          "sklearn", "pandas", "numpy", "fsspec", "upath", "s3fs", "jinja2", "multipart",
                          "tenacity"})


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered, or only the module of ``only`` (a command's name).

    Each command's module is imported only when registered: `kmend serve` does not load the node agent's
    modules (a quarter of a second of its start-up), nor `kmend agent` the control plane's.
    """
    parser = argparse.ArgumentParser(prog="kmend", description="Diagnose and heal GPU training clusters")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        default=os.environ.get("KMEND_LOG_LEVEL", "").lower() or None,
                        help="log level (KMEND_LOG_LEVEL; default info for serve and agent, warning otherwise)")
    parser.add_argument("--log-format", choices=["text", "json"],
                        default=os.environ.get("KMEND_LOG_FORMAT", "text").lower(),
                        help="text for people, json (one object per line) for log pipelines (KMEND_LOG_FORMAT)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in (only,) if only else COMMANDS:
        importlib.import_module(f"kmend.commands.{name}").register(sub)
    return parser


def setup_logging(level: str, fmt: str) -> None:
    """Logs to stderr, as text or as one JSON object per line (python-json-logger)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # One line per HTTP request is the access log's job, not kmend's.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word that is not an option names the command; anything else (help, a typo) gets every command.
    first = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(NAMES.get(first)).parse_args(argv)
    level = "debug" if args.verbose else args.log_level or ("info" if args.command in ("serve", "agent") else "warning")
    setup_logging(level, args.log_format)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kmend: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SERVICE_ONLY:
            raise
        print(f"kmend: `kmend {args.command}` needs the service extra ({exc.name} is not installed): "
              "pip install 'kmend[service]'", file=sys.stderr)
        return EXIT_CONFIG
    except BrokenPipeError:
        # `kmend analyze ... | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
