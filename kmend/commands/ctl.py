"""Operator commands in the style of kubectl, over the service's API.

``kmend get incidents|plans|nodes|spares [-o table|wide|json|yaml]``, ``kmend describe incident|plan ID``,
``kmend approve|reject PLAN``, ``kmend quarantine|release NODE``, ``kmend breaker [reset]``.

Where to connect comes from a context file like a kubeconfig (``$KMEND_CONFIG``, else
``~/.config/kmend/config.yaml``)::

    current-context: prod
    contexts:
      - name: prod
        server: https://kmend.example.org:8080
        token-file: ~/.config/kmend/prod.token     # or token: …
        operator: alice                            # recorded in the audit log

``--server``/``--token``/``--context`` and ``KMEND_SERVER``/``KMEND_TOKEN`` override it. Exit codes:
0 done, 1 the service refused (the message says why), 2 a configuration or usage error, 3 the service
could not be reached.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kmend.errors import ConfigError

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3


@dataclass(frozen=True, slots=True)
class Context:
    """Where and as whom the CLI talks to the service."""

    server: str
    """Base URL of the service."""
    token: str | None
    """Bearer token (operator or read-only)."""
    operator: str
    """Name recorded in the audit log."""


def config_path() -> Path:
    """The context file's path."""
    return Path(os.environ.get("KMEND_CONFIG") or Path.home() / ".config" / "kmend" / "config.yaml").expanduser()


def load_context(args: argparse.Namespace) -> Context:
    """Flags over environment over the context file; a broken file is a ConfigError naming it."""
    path = config_path()
    doc: dict[str, Any] = {}
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"KMEND_CONFIG={str(path)!r}: unreadable: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"KMEND_CONFIG={str(path)!r}: expected a mapping with 'contexts'")
        doc = loaded
    name = args.context or os.environ.get("KMEND_CONTEXT") or doc.get("current-context")
    ctx: Mapping[str, Any] = {}
    if name:
        found = [c for c in doc.get("contexts") or [] if isinstance(c, dict) and c.get("name") == name]
        if not found:
            raise ConfigError(f"context {name!r} not found in {path}")
        ctx = found[0]
    server = args.server or os.environ.get("KMEND_SERVER") or ctx.get("server") or "http://127.0.0.1:8080"
    token = args.token or os.environ.get("KMEND_TOKEN") or ctx.get("token")
    if not token and ctx.get("token-file"):
        tf = Path(str(ctx["token-file"])).expanduser()
        try:
            token = tf.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"context {name!r}: token-file {str(tf)!r}: {exc.strerror}") from None
    operator = ctx.get("operator") or os.environ.get("USER") or "operator"
    return Context(str(server).rstrip("/"), token, str(operator))


class Api:
    """The service's API with the context's token; errors become exit codes with a one-line reason."""

    def __init__(self, ctx: Context, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"X-Kmend-Operator": ctx.operator}
        if ctx.token:
            headers["Authorization"] = f"Bearer {ctx.token}"
        self.server = ctx.server
        self._client = httpx.Client(base_url=ctx.server, headers=headers, timeout=30, transport=transport)

    def call(self, method: str, path: str, **params: str) -> Any:
        try:
            resp = self._client.request(method, path, params={k: v for k, v in params.items() if v})
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach kmend at {self.server}: {exc}") from None
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise Refused(f"{method} {path}: {resp.status_code} {detail}")
        return resp.json()


class Refused(Exception):
    """The service answered 4xx/5xx."""


class Unreachable(Exception):
    """No answer from the service."""


# -- rendering ------------------------------------------------------------------------------------


def _age(ts: Any, now: float) -> str:
    if not isinstance(ts, int | float):
        return "-"
    s = max(0, int(now - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _rc(i: Mapping[str, Any]) -> str:
    rc = dict(i.get("root_cause") or {})
    if rc.get("job") is not None and rc.get("namespace"):
        rc["job"] = f"{rc['namespace']}/{rc['job']}"  # one name in two namespaces is two jobs
    parts = [rc.get("node")] + [f"{k}={rc[k]}" for k in ("gpu", "pci", "rank", "job") if rc.get(k) is not None]
    return " ".join(str(p) for p in parts if p) or "-"



def _plan_job(p: Mapping[str, Any]) -> str:
    job = p.get("job")
    return "-" if not job else f"{p['namespace']}/{job}" if p.get("namespace") else str(job)


Column = tuple[str, Callable[[Mapping[str, Any], float], Any]]

COLUMNS: dict[str, tuple[str, list[Column], list[Column]]] = {
    # resource: (list key, table columns, extra columns for -o wide)
    "incidents": ("incidents", [
        ("ID", lambda r, n: r["id"]), ("STATE", lambda r, n: r["state"]), ("CLASS", lambda r, n: r["fault_class"]),
        ("HARDWARE", lambda r, n: "yes" if r.get("hardware") else "no"),
        ("ACTION", lambda r, n: r["recommended_action"]), ("ROOT CAUSE", lambda r, n: _rc(r)),
        ("AGE", lambda r, n: _age(r.get("opened_at"), n)),
    ], [("FINDINGS", lambda r, n: r.get("finding_count", "")), ("JOBS", lambda r, n: ",".join(r.get("jobs", [])))]),
    "plans": ("plans", [
        ("ID", lambda r, n: r["id"]), ("STATE", lambda r, n: r["state"]), ("MODE", lambda r, n: r["mode"]),
        ("POLICY", lambda r, n: r["policy"]), ("NODE", lambda r, n: r.get("node") or "-"),
        ("STEPS", lambda r, n: f"{sum(s['state'] in ('succeeded', 'skipped') for s in r.get('steps', []))}/"
                               f"{len(r.get('steps', []))}"),
        ("AGE", lambda r, n: _age(r.get("created_at"), n)),
    ], [("INCIDENT", lambda r, n: r.get("incident_id")), ("JOB", lambda r, n: _plan_job(r))]),
    "nodes": ("nodes", [
        ("NAME", lambda r, n: r["name"]), ("STATE", lambda r, n: r["state"]),
        ("CORDONED", lambda r, n: "yes" if r.get("cordoned") else "no"), ("FAULT", lambda r, n: r.get("fault") or "-"),
        ("INCIDENTS", lambda r, n: ",".join(r.get("incidents", [])) or "-"),
    ], [("TAINTS", lambda r, n: ",".join(r.get("taints", [])) or "-")]),
    "spares": ("spares", [
        ("NAME", lambda r, n: r["name"]), ("STATE", lambda r, n: r["state"]),
        ("HEALTHY", lambda r, n: "yes" if r.get("healthy") else "no"),
        ("ASSIGNED TO", lambda r, n: r.get("assigned_to") or "-"),
    ], [("TOPOLOGY", lambda r, n: ",".join(f"{k.rsplit('/', 1)[-1]}={v}" for k, v in r.get("topology", {}).items()))]),
}


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], now: float) -> str:
    """Aligned columns, kubectl style."""
    from tabulate import tabulate

    body = [[str(fn(r, now)) for _, fn in columns] for r in rows]
    if not body:
        return "No resources found."
    return str(tabulate(body, headers=[h for h, _ in columns], tablefmt="plain", disable_numparse=True))


def emit(data: Any, output: str) -> None:
    """JSON or YAML for scripts."""
    if output == "json":
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        yaml.safe_dump(data, sys.stdout, sort_keys=True)


def describe_incident(i: Mapping[str, Any], now: float) -> str:
    """An incident for people: root cause, evidence lines, timeline."""
    lines = [f"Incident:     {i['id']}", f"State:        {i['state']}",
             f"Fault class:  {i['fault_class']} ({'hardware' if i.get('hardware') else 'application'})",
             f"Action:       {i['recommended_action']}", f"Root cause:   {_rc(i)}",
             f"Jobs:         {', '.join(i.get('jobs', [])) or '-'}",
             f"Opened:       {_when(i.get('opened_at'))} ({_age(i.get('opened_at'), now)} ago)", "Evidence:"]
    for f in (i.get("findings") or [])[:20]:
        loc = dict(f.get("where") or {})
        if loc.get("job") is not None and loc.get("namespace"):
            loc["job"] = f"{loc.pop('namespace')}/{loc['job']}"
        where = " ".join(f"{k}={v}" for k, v in loc.items() if v is not None)
        lines.append(f"  {f.get('rule_id', '?'):<28} {where}")
        if f.get("message"):
            lines.append(f"    {str(f['message'])[:300]}")
    extra = len(i.get("findings") or []) - 20
    if extra > 0:
        lines.append(f"  … and {extra} more findings")
    lines.append("Timeline:")
    lines += [f"  {_when(t.get('ts'))}  {t.get('what')}" for t in i.get("timeline", [])]
    return "\n".join(lines)


def describe_plan(p: Mapping[str, Any], now: float) -> str:
    """A plan for people: mode, state and each step's result."""
    lines = [f"Plan:      {p['id']}", f"Incident:  {p.get('incident_id')}", f"Policy:    {p.get('policy')}",
             f"Mode:      {p.get('mode')}", f"State:     {p.get('state')}", f"Job:       {_plan_job(p)}",
             f"Reason:    {p.get('reason', '')}",
             "Steps:"]
    for s in p.get("steps", []):
        lines.append(f"  {s['kind']:<12} {s['state']:<10} {s.get('node') or ''}  {s.get('result') or ''}")
    return "\n".join(lines)


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- commands -------------------------------------------------------------------------------------


def _get(api: Api, args: argparse.Namespace, now: float) -> None:
    key, cols, wide = COLUMNS[args.resource]
    path = f"/v1/{args.resource}"
    data = api.call("GET", path, state=args.state or "", node=args.node or "")
    rows = data.get(key, [])
    if isinstance(rows, Mapping):  # keyed by name (nodes)
        rows = [{"name": k, **v} for k, v in rows.items()]
    if args.output in ("json", "yaml"):
        emit(data, args.output)
    else:
        print(table(rows, cols + (wide if args.output == "wide" else []), now))


def _describe(api: Api, args: argparse.Namespace, now: float) -> None:
    kind = "incidents" if args.kind in ("incident", "incidents") else "plans"
    data = api.call("GET", f"/v1/{kind}/{args.id}")
    if args.output in ("json", "yaml"):
        emit(data, args.output)
    else:
        print(describe_incident(data, now) if kind == "incidents" else describe_plan(data, now))


def _action(api: Api, args: argparse.Namespace, now: float) -> None:
    path = {"approve": f"/v1/plans/{args.target}/approve", "reject": f"/v1/plans/{args.target}/reject",
            "quarantine": f"/v1/nodes/{args.target}/quarantine", "release": f"/v1/nodes/{args.target}/release"}
    data = api.call("POST", path[args.command])
    if args.output in ("json", "yaml"):
        emit(data, args.output)
        return
    what = {"approve": "approved", "reject": "rejected", "quarantine": "quarantined", "release": "released"}
    state = data.get("state")
    print(f"{args.target} {what[args.command]}" + (f" (plan {data['id']} {state})" if "id" in data else ""))


def _breaker(api: Api, args: argparse.Namespace, now: float) -> None:
    data = api.call("POST", "/v1/breaker/reset") if args.reset == "reset" else api.call("GET", "/v1/breaker")
    if args.output in ("json", "yaml"):
        emit(data, args.output)
        return
    state = "TRIPPED" if data.get("tripped") else "closed"
    print(f"breaker {state}" + (f": {data['reason']}" if data.get("tripped") else "")
          + f" (limit {data.get('max_fraction')} of GPU nodes per {data.get('window_s')} s)")


def run(args: argparse.Namespace) -> int:
    """Run one operator command; exit codes as the module says."""
    import time

    api = Api(load_context(args))
    try:
        args.handler(api, args, time.time())
    except Refused as exc:
        print(f"kmend: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except Unreachable as exc:
        print(f"kmend: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


def _common(p: argparse.ArgumentParser, *, output: bool = True) -> None:
    p.add_argument("--server", help="kmend URL (KMEND_SERVER; default from the context file)")
    p.add_argument("--token", help="bearer token (KMEND_TOKEN)")
    p.add_argument("--context", help="context in the context file (KMEND_CONTEXT)")
    if output:
        p.add_argument("-o", "--output", choices=["table", "wide", "json", "yaml"], default="table")
    p.set_defaults(func=run)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add get, describe, approve, reject, quarantine, release and breaker."""
    p = sub.add_parser("get", help="list incidents, plans, nodes or spares")
    p.add_argument("resource", choices=sorted(COLUMNS))
    p.add_argument("--state", help="only this state (incidents, plans)")
    p.add_argument("--node", help="only this node (incidents, plans)")
    _common(p)
    p.set_defaults(handler=_get)
    p = sub.add_parser("describe", help="one incident (root cause, evidence, timeline) or plan (steps)")
    p.add_argument("kind", choices=["incident", "incidents", "plan", "plans"])
    p.add_argument("id")
    _common(p)
    p.set_defaults(handler=_describe)
    for name, helptext in (("approve", "approve a plan waiting for approval"), ("reject", "reject a plan"),
                           ("quarantine", "cordon, taint and mark a node"),
                           ("release", "put a node back in service, cancelling kmend's plans for it")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("target", metavar="PLAN" if name in ("approve", "reject") else "NODE")
        _common(p)
        p.set_defaults(handler=_action)
    p = sub.add_parser("breaker", help="show the circuit breaker, or reset it")
    p.add_argument("reset", nargs="?", choices=["reset"])
    _common(p)
    p.set_defaults(handler=_breaker)
