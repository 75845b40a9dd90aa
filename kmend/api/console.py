"""The web console: server-rendered pages over the same service core as the API.

Open incidents with root cause, evidence and timeline; a node health map laid out by topology
(spine → leaf → node); plans with their steps, refreshed while they run, and approve / reject /
dry-run buttons; spares; the breaker; the audit log. No JavaScript is needed to use it.

Access: with no tokens configured (loopback development) anyone who reaches the port may view and
act, as with the API. Otherwise the login form takes a token, kept in an HttpOnly, SameSite=Strict
cookie: the operator token views and acts, the read-only token (KMEND_READER_TOKEN) only views. Every form
carries a token derived from the cookie (CSRF) and every action is audited under the name given
at login.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from analyzer.records import IncidentState
from healer.cluster import NotFoundError
from kmend.api.deps import KmendDep, SettingsDep
from kmend.healing import NotAllowed
from kmend.serialize import incident_to_dict, plan_to_dict
from kmend.settings import Settings

router = APIRouter(prefix="/console", tags=["console"], include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).resolve().parent.parent / "console" / "templates"))
COOKIE = "kmend_console"
OPEN_STATES = (IncidentState.OPEN, IncidentState.REMEDIATING)


def job_name(where: Any) -> str:
    """A job as people should read it: ``namespace/job`` (one name in two namespaces is two jobs), else the name."""
    if not where or not where.get("job"):
        return ""
    return f"{where['namespace']}/{where['job']}" if where.get("namespace") else str(where["job"])


templates.env.filters["job_name"] = job_name


def _role(settings: Settings, token: str | None) -> str | None:
    """``operator``, ``viewer`` or None (no access) for the cookie's token."""
    op = settings.operator_token.get_secret_value() if settings.operator_token else None
    reader = settings.reader_token.get_secret_value() if settings.reader_token else None
    ing = settings.ingest_token.get_secret_value() if settings.ingest_token else None
    if op is None and reader is None and ing is None:
        return "operator"  # no tokens: a loopback-only development server, as the API itself
    if token and op and hmac.compare_digest(token.encode(), op.encode()):
        return "operator"
    if token and reader and hmac.compare_digest(token.encode(), reader.encode()):
        return "viewer"
    return None  # the collectors' ingest token opens nothing here


def _csrf(token: str | None) -> str:
    return hashlib.sha256(f"kmend-console-csrf:{token or ''}".encode()).hexdigest()[:32]


class Viewer:
    """Who is looking, from the cookie."""

    def __init__(self, request: Request, settings: Settings) -> None:
        raw = request.cookies.get(COOKIE, "")
        token, _, name = raw.partition("|")
        self.token = token or None
        self.name = (name or "operator")[:64]
        self.role = _role(settings, self.token)
        self.csrf = _csrf(self.token)


def _page(request: Request, settings: Settings, template: str, **ctx: Any) -> Response:
    viewer = Viewer(request, settings)
    if viewer.role is None:
        return RedirectResponse(f"/console/login?next={request.url.path}", status_code=303)
    return templates.TemplateResponse(request, template, {"viewer": viewer, "now": time.time(), **ctx})


def _act(request: Request, settings: Settings, csrf: str) -> str:
    """The operator's name, after checking the role and the form's CSRF token."""
    viewer = Viewer(request, settings)
    if viewer.role != "operator":
        raise HTTPException(403, "the operator token is needed to act")
    if not hmac.compare_digest(csrf.encode(), viewer.csrf.encode()):
        raise HTTPException(403, "stale or forged form (CSRF token does not match)")
    return f"{viewer.name} (console)"


@router.get("", include_in_schema=False)
def index() -> RedirectResponse:
    """The console starts at the open incidents."""
    return RedirectResponse("/console/incidents", status_code=303)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/console/incidents") -> Response:
    """Token and name form."""
    return templates.TemplateResponse(request, "login.html", {"next": next if next.startswith("/console") else
                                                              "/console/incidents", "viewer": None, "error": ""})


@router.post("/login")
def login(request: Request, settings: SettingsDep, token: Annotated[str, Form(max_length=512)],
          name: Annotated[str, Form(max_length=64)] = "operator",
          next: Annotated[str, Form(max_length=200)] = "/console/incidents") -> Response:
    """Check the token and keep it in a cookie only this console reads."""
    if _role(settings, token) is None:
        return templates.TemplateResponse(request, "login.html", {"next": next, "viewer": None,
                                                                  "error": "That token is not accepted."},
                                          status_code=401)
    resp = RedirectResponse(next if next.startswith("/console") else "/console/incidents", status_code=303)
    resp.set_cookie(COOKIE, f"{token}|{name.replace('|', ' ')}", httponly=True, samesite="strict",
                    path="/console", secure=request.url.scheme == "https")
    return resp


@router.post("/logout")
def logout() -> Response:
    """Forget the token."""
    resp = RedirectResponse("/console/login", status_code=303)
    resp.delete_cookie(COOKIE, path="/console")
    return resp


@router.get("/incidents", response_class=HTMLResponse)
def incidents_page(request: Request, kmend: KmendDep, settings: SettingsDep, all: bool = False) -> Response:
    """Incidents, open ones first, with root cause and action."""
    incs = [i for i in kmend.incidents() if all or i.state in OPEN_STATES]
    incs.sort(key=lambda i: (i.state not in OPEN_STATES, -i.updated_at))
    return _page(request, settings, "incidents.html", incidents=[incident_to_dict(i, findings=False) for i in incs],
                 show_all=all)


@router.get("/incidents/{incident_id}", response_class=HTMLResponse)
def incident_page(incident_id: str, request: Request, kmend: KmendDep, settings: SettingsDep) -> Response:
    """One incident: root cause, evidence lines, timeline, its plans."""
    inc = next((i for i in kmend.incidents() if i.id == incident_id), None)
    if inc is None:
        raise HTTPException(404, f"no incident {incident_id!r}")
    plans = [plan_to_dict(p) for p in kmend.store.list_plans() if p.incident_id == incident_id]
    return _page(request, settings, "incident.html", inc=incident_to_dict(inc), plans=plans)


def _topology(nodes: dict[str, dict[str, Any]], labels: dict[str, dict[str, str]],
              keys: tuple[str, ...]) -> list[tuple[str, list[tuple[str, list[tuple[str, dict[str, Any]]]]]]]:
    """spine → leaf → nodes, by the policy's topology label keys (leaf key first)."""
    leaf_key = keys[0] if keys else ""
    spine_key = keys[1] if len(keys) > 1 else ""
    tree: dict[str, dict[str, list[tuple[str, dict[str, Any]]]]] = {}
    for name in sorted(nodes):
        lab = labels.get(name, {})
        tree.setdefault(lab.get(spine_key, "—"), {}).setdefault(lab.get(leaf_key, "—"), []).append((name, nodes[name]))
    return [(s, sorted(leaves.items())) for s, leaves in sorted(tree.items())]


@router.get("/nodes", response_class=HTMLResponse)
def nodes_page(request: Request, kmend: KmendDep, settings: SettingsDep) -> Response:
    """The node health map by topology."""
    health = kmend.node_health()
    labels = {n.name: dict(n.labels) for n in kmend.cluster.list_nodes()}
    keys = tuple(kmend.healing.policy.topology_keys)
    counts: dict[str, int] = {}
    for h in health.values():
        counts[h["state"]] = counts.get(h["state"], 0) + 1
    return _page(request, settings, "nodes.html", tree=_topology(health, labels, keys), counts=counts)


@router.get("/nodes/{name}", response_class=HTMLResponse)
def node_page(name: str, request: Request, kmend: KmendDep, settings: SettingsDep) -> Response:
    """One node: state, taints, conditions, and the GPUs its incidents name."""
    health = kmend.node_health()
    if name not in health:
        raise HTTPException(404, f"no node {name!r}")
    incs = [incident_to_dict(i) for i in kmend.incidents() if i.root_cause.node == name]
    gpus: dict[str, list[dict[str, Any]]] = {}
    for i in incs:
        for f in i.get("findings", []):
            w = f.get("where") or {}
            if w.get("node") == name and (w.get("gpu") is not None or w.get("pci")):
                gpus.setdefault(str(w.get("pci") or f"GPU {w.get('gpu')}"), []).append(
                    {"incident": i["id"], "rule": f["rule_id"], "class": f["fault_class"], "message": f["message"]})
    return _page(request, settings, "node.html", name=name, node=health[name], incidents=incs, gpus=gpus)


@router.get("/plans", response_class=HTMLResponse)
def plans_page(request: Request, kmend: KmendDep, settings: SettingsDep) -> Response:
    """Plans, newest first."""
    plans = sorted((plan_to_dict(p) for p in kmend.store.list_plans()), key=lambda p: -float(p["created_at"]))
    return _page(request, settings, "plans.html", plans=plans)


@router.get("/plans/{plan_id}", response_class=HTMLResponse)
def plan_page(plan_id: str, request: Request, kmend: KmendDep, settings: SettingsDep,
              preview: bool = False) -> Response:
    """One plan with its steps (refreshing while it runs) and the actions it allows."""
    plan = kmend.store.get_plan(plan_id)
    if plan is None:
        raise HTTPException(404, f"no plan {plan_id!r}")
    would: list[dict[str, Any]] = []
    if preview:
        _, preview_steps = kmend.healing.execute(plan_id, "console preview", kmend.set_incident_state, dry_run=True)
        would = list(preview_steps or [])
    return _page(request, settings, "plan.html", plan=plan_to_dict(plan), would=would)


@router.post("/plans/{plan_id}/{action}")
def plan_action(plan_id: str, action: str, request: Request, kmend: KmendDep, settings: SettingsDep,
                csrf: Annotated[str, Form(max_length=64)]) -> Response:
    """Approve, reject or run a plan from the console (audited)."""
    who = _act(request, settings, csrf)
    try:
        if action == "approve":
            kmend.healing.approve(plan_id, who, kmend.set_incident_state)
        elif action == "reject":
            kmend.healing.reject(plan_id, who)
        elif action == "dry-run":
            return RedirectResponse(f"/console/plans/{plan_id}?preview=true", status_code=303)
        else:
            raise HTTPException(404, f"no action {action!r}")
    except KeyError:
        raise HTTPException(404, f"no plan {plan_id!r}") from None
    except NotAllowed as exc:
        raise HTTPException(409, str(exc)) from None
    kmend.store.ledger.audit(who, "POST", f"/v1/plans/{plan_id}/{action}", 200, {"via": "console"})
    kmend.wake()
    return RedirectResponse(f"/console/plans/{plan_id}", status_code=303)


@router.get("/spares", response_class=HTMLResponse)
def spares_page(request: Request, kmend: KmendDep, settings: SettingsDep) -> Response:
    """The hot-spare pool."""
    return _page(request, settings, "spares.html", spares=kmend.healing.spares(), breaker=kmend.healing.breaker(),
                 safety=kmend.healing.policy.safety)


@router.post("/breaker/reset")
def breaker_reset(request: Request, kmend: KmendDep, settings: SettingsDep,
                  csrf: Annotated[str, Form(max_length=64)]) -> Response:
    """Close the breaker (audited)."""
    who = _act(request, settings, csrf)
    kmend.healing.reset_breaker(who)
    kmend.store.ledger.audit(who, "POST", "/v1/breaker/reset", 200, {"via": "console"})
    return RedirectResponse("/console/spares", status_code=303)


@router.post("/nodes/{name}/{action}")
def node_action(name: str, action: str, request: Request, kmend: KmendDep, settings: SettingsDep,
                csrf: Annotated[str, Form(max_length=64)]) -> Response:
    """Quarantine or release a node from the console (audited)."""
    who = _act(request, settings, csrf)
    try:
        if action == "quarantine":
            kmend.healing.quarantine(name, who, "quarantined from the console")
        elif action == "release":
            kmend.healing.release(name, who)
        else:
            raise HTTPException(404, f"no action {action!r}")
    except NotFoundError:
        raise HTTPException(404, f"no node {name!r}") from None
    kmend.store.ledger.audit(who, "POST", f"/v1/nodes/{name}/{action}", 200, {"via": "console"})
    kmend.wake()
    return RedirectResponse(f"/console/nodes/{name}", status_code=303)


@router.get("/audit", response_class=HTMLResponse)
def audit_page(request: Request, kmend: KmendDep, settings: SettingsDep) -> Response:
    """Who did what (operator role only: it names people)."""
    if Viewer(request, settings).role not in ("operator", None):
        raise HTTPException(403, "the operator token is needed to read the audit log")
    return _page(request, settings, "audit.html", entries=kmend.store.ledger.audit_entries(200))
