"""The quarantine circuit breaker: state and reset."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from healer.safety import BreakerState
from kmend.api.deps import KmendDep, OperatorAuth, OperatorDep

router = APIRouter(prefix="/v1/breaker", tags=["runbook"], dependencies=[OperatorAuth])


def _view(b: BreakerState, kmend: KmendDep) -> dict[str, Any]:
    s = kmend.healing.policy.safety
    return {"tripped": b.tripped, "tripped_at": b.tripped_at, "reason": b.reason, "reset_at": b.reset_at,
            "reset_by": b.reset_by, "max_fraction": s.breaker_max_fraction, "window_s": s.breaker_window_s}


@router.get("")
def get_breaker(kmend: KmendDep) -> dict[str, Any]:
    """Whether automatic quarantines are stopped, and why."""
    return _view(kmend.healing.breaker(), kmend)


@router.post("/reset")
def reset_breaker(kmend: KmendDep, who: OperatorDep) -> dict[str, Any]:
    """Close the breaker; plans it blocked stay blocked until executed (POST /v1/plans/{id}/execute)."""
    return _view(kmend.healing.reset_breaker(who), kmend)
