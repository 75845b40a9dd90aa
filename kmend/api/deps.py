"""Dependencies shared by the routers (Annotated aliases), and who may call what.

Three kinds of caller: collectors (``ingest``), read-only operators and dashboards
(``reader``: GET routes and /metrics) and operators (``operator``: everything a reader may,
plus the runbook). A caller proves its kind with the bearer token configured for it, or,
with TokenReview on, with a Kubernetes token whose user or group is listed for that kind.
Every route but /healthz and /readyz needs one; only with nothing configured at all is the
API open, and then ``kmend serve`` listens on loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from healer.identity import Identity, TokenReviewer
from kmend.service import Kmend
from kmend.settings import Settings

log = logging.getLogger("kmend.auth")

INGEST, READER, OPERATOR = "ingest", "reader", "operator"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made a request, for the checks and the audit log."""

    kind: str
    """``ingest``, ``reader``, ``operator`` or ``anonymous`` (open mode)."""
    name: str
    """The identity proven: ``<kind>-token`` or the Kubernetes username."""


def get_kmend(request: Request) -> Kmend:
    """The service core of this app."""
    kmend: Kmend = request.app.state.kmend
    return kmend


def get_settings(request: Request) -> Settings:
    """The settings this app was built with."""
    settings: Settings = request.app.state.settings
    return settings


KmendDep = Annotated[Kmend, Depends(get_kmend)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def auth_open(settings: Settings) -> bool:
    """True when no token and no TokenReview is configured: the API is open (loopback only)."""
    tokens = (settings.ingest_token, settings.operator_token, settings.reader_token)
    return all(t is None for t in tokens) and not settings.token_review


class ReviewCache:
    """TokenReview answers for a minute, so a dashboard polling every second costs one review a minute."""

    def __init__(self, reviewer: TokenReviewer, *, ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reviewer = reviewer
        self.ttl_s = ttl_s
        self.clock = clock
        self._seen: dict[str, tuple[float, Identity | None]] = {}

    def review(self, token: str) -> Identity | None:
        """The cached or fresh identity of `token`."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        hit = self._seen.get(key)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        ident = self.reviewer.review(token)
        if len(self._seen) > 10_000:
            self._seen.clear()
        self._seen[key] = (now, ident)
        return ident


def _kinds_of(identity: Identity, settings: Settings) -> set[str]:
    names = {identity.username} | set(identity.groups)
    out = set()
    for kind, allowed in ((INGEST, settings.token_review_ingest), (READER, settings.token_review_readers),
                          (OPERATOR, settings.token_review_operators)):
        if names & set(allowed):
            out.add(kind)
    return out


def _token_kinds(token: str, settings: Settings) -> set[str]:
    out = set()
    for kind, secret in ((INGEST, settings.ingest_token), (READER, settings.reader_token),
                         (OPERATOR, settings.operator_token)):
        if secret is not None and hmac.compare_digest(token.encode(), secret.get_secret_value().encode()):
            out.add(kind)
    return out


def _unauthorized(needed: frozenset[str]) -> HTTPException:
    settings_named = ", ".join(f"KMEND_{k.upper()}_TOKEN" for k in sorted(needed))
    return HTTPException(status_code=401, detail=f"missing or wrong bearer token: this route needs a "
                                                 f"{' or '.join(sorted(needed))} token ({settings_named})",
                         headers={"WWW-Authenticate": "Bearer"})


def authenticate(request: Request, settings: Settings, authorization: str | None,
                 needed: frozenset[str]) -> Caller:
    """The caller, if its token is of a kind in `needed`; raises 401 (unknown) or 403 (wrong kind)."""
    if auth_open(settings):
        return Caller("anonymous", "anonymous")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized(needed)
    kinds = _token_kinds(token, settings)
    name = ""
    if kinds:
        kind = next(k for k in (OPERATOR, READER, INGEST) if k in kinds)
        name = f"{kind}-token"
    elif settings.token_review:
        cache: ReviewCache | None = getattr(request.app.state, "token_reviews", None)
        if cache is None:
            raise HTTPException(503, "token_review is on but no TokenReview client is configured")
        try:
            ident = cache.review(token)
        except Exception as exc:  # the API server is away: the caller may retry
            log.warning("TokenReview failed: %s", exc)
            raise HTTPException(503, "cannot review the token now (Kubernetes API unavailable)") from exc
        if ident is not None:
            kinds = _kinds_of(ident, settings)
            name = ident.username
            if not kinds:
                raise HTTPException(403, f"{ident.username} is not listed for any kind (settings "
                                         "KMEND_TOKEN_REVIEW_INGEST, _READERS, _OPERATORS)")
    if not kinds:
        raise _unauthorized(needed)
    # An operator may do what a reader may.
    granted = kinds | ({READER} if OPERATOR in kinds else set())
    if not granted & needed:
        raise HTTPException(403, f"a {'/'.join(sorted(kinds))} token cannot call this route "
                                 f"(it needs {' or '.join(sorted(needed))})")
    caller = Caller(next(k for k in (OPERATOR, READER, INGEST) if k in granted & needed), name)
    request.state.caller = caller
    return caller


def _require(*kinds: str) -> Callable[..., Caller]:
    needed = frozenset(kinds)

    def check(request: Request, settings: SettingsDep,
              authorization: Annotated[str | None, Header()] = None) -> Caller:
        return authenticate(request, settings, authorization, needed)

    return check


require_ingest_token = _require(INGEST)
"""Collectors: signals, Fluent Bit, Alertmanager, Flight Recorder dumps."""
require_reader = _require(READER)
"""Reads: incidents, nodes, /metrics (a reader or an operator token)."""
require_operator_token = _require(OPERATOR)
"""The runbook: plans, breaker, spares, quarantine, audit (the collectors' token never suffices)."""
require_agent_or_operator = _require(INGEST, OPERATOR)
"""Node requests, polled and answered by node agents or operators."""

IngestAuth = Depends(require_ingest_token)
ReadAuth = Depends(require_reader)
OperatorAuth = Depends(require_operator_token)
AgentOrOperatorAuth = Depends(require_agent_or_operator)


def describe(caller: Caller | None, claimed: str | None) -> str:
    """``<proven identity> (<claimed name>)``: the token (or Kubernetes user) proves the role, the
    ``X-Kmend-Operator`` header only names the person."""
    proven = caller.name if caller is not None else "unauthenticated"
    return f"{proven} ({claimed[:128]})" if claimed else proven


def operator_name(request: Request, x_kmend_operator: Annotated[str | None, Header()] = None) -> str:
    """Who is calling, for plan reasons and the audit log (see ``describe``)."""
    return describe(getattr(request.state, "caller", None), x_kmend_operator)


OperatorDep = Annotated[str, Depends(operator_name)]
