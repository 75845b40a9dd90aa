"""Dependencies shared by the routers (Annotated aliases)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from kmend.service import Kmend
from kmend.settings import Settings


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


def require_ingest_token(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Collectors must present the ingest bearer token when one is configured."""
    if settings.ingest_token is None:
        return
    expected = f"Bearer {settings.ingest_token.get_secret_value()}"
    if authorization is None or not hmac.compare_digest(authorization.encode(), expected.encode()):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


IngestAuth = Depends(require_ingest_token)


def _bearer_ok(authorization: str | None, token: str) -> bool:
    expected = f"Bearer {token}"
    return authorization is not None and hmac.compare_digest(authorization.encode(), expected.encode())


def operator_name(x_kmend_operator: Annotated[str | None, Header()] = None) -> str:
    """Who is calling, for the audit log (``X-Kmend-Operator``; the token proves the role, not the person)."""
    return (x_kmend_operator or "operator")[:128]


def require_operator_token(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Runbook calls need the operator token when one is set; the collectors' ingest token never suffices."""
    if settings.operator_token is None:
        return
    if not _bearer_ok(authorization, settings.operator_token.get_secret_value()):
        raise HTTPException(status_code=401, detail="missing or wrong operator bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def require_agent_or_operator(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Node requests are polled and answered by node agents (ingest token) or operators (operator token)."""
    tokens = [t.get_secret_value() for t in (settings.ingest_token, settings.operator_token) if t is not None]
    if tokens and not any(_bearer_ok(authorization, t) for t in tokens):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


OperatorAuth = Depends(require_operator_token)
AgentOrOperatorAuth = Depends(require_agent_or_operator)
OperatorDep = Annotated[str, Depends(operator_name)]
