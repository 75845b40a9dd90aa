"""The `kmend` command: the only entry point that imports the service."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kmend.commands import agent, analyze, ctl, demo, evaluate, fluentbit, policy, rules, serve
from kmend.errors import EXIT_CONFIG, ConfigError

# Installed by the `service` extra only: the agent image and `pip install kmend` leave them out.
SERVICE_ONLY = frozenset({"fastapi", "uvicorn", "starlette", "sqlalchemy", "alembic", "psycopg", "kubernetes",
                          "sklearn", "pandas", "numpy", "fsspec", "upath", "s3fs", "jinja2", "multipart",
                          "tenacity"})


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="kmend", description="Diagnose and heal GPU training clusters")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        default=os.environ.get("KMEND_LOG_LEVEL", "").lower() or None,
                        help="log level (KMEND_LOG_LEVEL; default info for serve and agent, warning otherwise)")
    parser.add_argument("--log-format", choices=["text", "json"],
                        default=os.environ.get("KMEND_LOG_FORMAT", "text").lower(),
                        help="text for people, json (one object per line) for log pipelines (KMEND_LOG_FORMAT)")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (serve, agent, analyze, demo, fluentbit, rules, evaluate, policy, ctl):
        module.register(sub)
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
    args = build_parser().parse_args(argv)
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
