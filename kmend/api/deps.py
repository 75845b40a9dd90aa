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
