"""`kmend serve`: the control plane."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    p = sub.add_parser("serve", help="run the control plane (API, analyzer, healer)")
    p.add_argument("--host", help="listen address (KMEND_HOST)")
    p.add_argument("--port", type=int, help="listen port (KMEND_PORT)")
    p.add_argument("--database-url", help="SQLAlchemy URL (KMEND_DATABASE_URL)")
    p.add_argument("--cluster", choices=["auto", "sim", "kube"], help="cluster adapter (KMEND_CLUSTER)")
    p.add_argument("--dry-run", action="store_true", default=None, help="plan but change nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    # Imported here so that `kmend agent` on every node does not load the web stack.
    import uvicorn

    from kmend.app import create_app
    from kmend.settings import Settings
    from kmend.wiring import listen_host, make_kmend, make_token_reviewer

    overrides = {k: v for k, v in {
        "host": args.host, "port": args.port, "database_url": args.database_url,
        "cluster": args.cluster, "dry_run": args.dry_run,
    }.items() if v is not None}
    settings = Settings(**overrides)
    host = listen_host(settings)  # loopback only (and a loud warning) while no token is configured
    kmend = make_kmend(settings)
    app = create_app(kmend, settings, token_reviewer=make_token_reviewer(settings))
    uvicorn.run(app, host=host, port=settings.port, log_level="info")
    return 0
