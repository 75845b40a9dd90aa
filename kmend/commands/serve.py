"""`kmend serve`: the control plane."""

from __future__ import annotations

import argparse
import gc
from typing import TYPE_CHECKING

from pydantic import ValidationError

from kmend.errors import ConfigError, from_validation, redact_url
from kmend.settings import Settings

if TYPE_CHECKING:
    from kmend.early import Early
    from kmend.service import Kmend


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    p = sub.add_parser("serve", help="run the control plane (API, analyzer, healer)")
    p.add_argument("--host", help="listen address (KMEND_HOST)")
    p.add_argument("--port", type=int, help="listen port (KMEND_PORT)")
    p.add_argument("--database-url", help="SQLAlchemy URL (KMEND_DATABASE_URL)")
    p.add_argument("--cluster", choices=["auto", "sim", "kube"], help="cluster adapter (KMEND_CLUSTER)")
    p.add_argument("--dry-run", action="store_true", default=None, help="plan but change nothing")
    p.set_defaults(func=run)


def start_cluster(settings: Settings) -> Early | None:
    """On a real cluster, its ports and the gang scheduler, started before the rest (``kmend.early``)."""
    from healer.cluster import ClusterConfigError
    from kmend.early import start_early

    try:
        return start_early(settings)
    except ClusterConfigError as exc:
        raise _cluster_error(settings, exc) from None


def _cluster_error(settings: Settings, exc: Exception) -> ConfigError:
    return ConfigError(f"KMEND_CLUSTER={settings.cluster!r}, KMEND_KUBECONFIG="
                       f"{str(settings.kubeconfig or '~/.kube/config')!r}: {exc}")


def build_service(settings: Settings, early: Early | None = None) -> Kmend:
    """The service, started (schema migrated, state rebuilt); a setting that stops it is a ConfigError."""
    from sqlalchemy.exc import SQLAlchemyError

    from analyzer.rules import RuleError
    from healer.cluster import ClusterConfigError
    from healer.policy_file import PolicyError
    from kmend.wiring import make_kmend

    try:
        kmend = make_kmend(settings, early=early)
    except PolicyError as exc:
        raise ConfigError(f"KMEND_POLICY_FILE={str(settings.policy_file or 'the shipped policy')!r}: {exc}") from None
    except RuleError as exc:
        raise ConfigError(f"KMEND_RULES_DIRS / KMEND_PROGRESS_RULES_DIRS: {exc}") from None
    except ClusterConfigError as exc:
        raise _cluster_error(settings, exc) from None
    except SQLAlchemyError as exc:
        raise _database_error(settings, exc) from None
    try:
        kmend.start()
    except SQLAlchemyError as exc:
        raise _database_error(settings, exc) from None
    return kmend


def _database_error(settings: Settings, exc: Exception) -> ConfigError:
    first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    return ConfigError(f"KMEND_DATABASE_URL={redact_url(settings.database_url)!r}: cannot use the database: {first}")


GC_THRESHOLDS = (50_000, 20, 100)
"""Young collections every 50,000 net allocations instead of 700 (the interpreter's default)."""


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for a process that builds thousands of short-lived objects per batch.

    A 1,000-signal batch counts some 6,000 container allocations against the threshold; at the default
    the collector ran 8 times per batch, and every tenth run also scanned the older generations, where
    the service's long-lived state is (rules, compiled databases, restored incidents): about a quarter
    of ingest's CPU in-process. What start-up built is moved out of the collector's sight (``gc.freeze``:
    it lives as long as the process), and young collections run every 50,000 allocations. Reference
    counting still frees almost everything at once; the collector only finds cycles, which wait longer.
    (No full collection first: it cost 0.07 CPU-s of start-up for a few cycles left from loading.)
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    overrides = {k: v for k, v in {
        "host": args.host, "port": args.port, "database_url": args.database_url,
        "cluster": args.cluster, "dry_run": args.dry_run,
    }.items() if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise from_validation(exc, prefix="KMEND_", flags={k: "--" + k.replace("_", "-") for k in overrides}) from None
    # Before the web stack, the rules' matcher and the store: a gang waiting for kmend is placed meanwhile.
    early = start_cluster(settings)
    # Imported here so that `kmend agent` on every node does not load the web stack.
    import uvicorn

    from kmend.app import create_app
    from kmend.wiring import listen_host, make_token_reviewer

    host = listen_host(settings)  # loopback only (and a loud warning) while no token is configured
    try:
        kmend = build_service(settings, early)
    except BaseException:
        if early is not None and early.loop is not None:
            early.loop.stop()
        raise
    app = create_app(kmend, settings, token_reviewer=make_token_reviewer(settings),
                     scheduler_loop=early.loop if early is not None else None)
    tune_gc()
    uvicorn.run(app, host=host, port=settings.port, log_level="info")
    return 0
