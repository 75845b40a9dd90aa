"""Plans: list, detail, approve, reject, execute (or preview with dry_run=true)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query

from healer.records import PlanState
from kmend.api.deps import KmendDep, OperatorAuth, OperatorDep
from kmend.healing import NotAllowed
from kmend.serialize import plan_to_dict

router = APIRouter(prefix="/v1/plans", tags=["runbook"], dependencies=[OperatorAuth])


@router.get("")
def list_plans(kmend: KmendDep, state: PlanState | None = None, node: str | None = None,
               limit: int = Query(500, ge=1, le=5000)) -> dict[str, Any]:
    """Plans, newest first."""
    plans = kmend.store.list_plans(state=state.value if state else None, node=node)
    return {"plans": [plan_to_dict(p) for p in reversed(plans)][:limit]}


@router.get("/{plan_id}")
def get_plan(plan_id: str, kmend: KmendDep) -> dict[str, Any]:
    """One plan with every step's state, result and outputs."""
    try:
        return plan_to_dict(kmend.healing.plan(plan_id))
    except KeyError:
        raise HTTPException(404, f"no plan {plan_id!r}") from None


@router.post("/{plan_id}/approve")
def approve(plan_id: str, kmend: KmendDep, who: OperatorDep) -> dict[str, Any]:
    """Run a plan that waits for approval."""
    try:
        return plan_to_dict(kmend.healing.approve(plan_id, who, kmend.set_incident_state))
    except KeyError:
        raise HTTPException(404, f"no plan {plan_id!r}") from None
    except NotAllowed as exc:
        raise HTTPException(409, str(exc)) from None


@router.post("/{plan_id}/reject")
def reject(plan_id: str, kmend: KmendDep, who: OperatorDep) -> dict[str, Any]:
    """Refuse a waiting plan (nothing of it runs) or stop a running one after its step in flight; answers at once."""
    try:
        return plan_to_dict(kmend.healing.reject(plan_id, who))
    except KeyError:
        raise HTTPException(404, f"no plan {plan_id!r}") from None
    except NotAllowed as exc:
        raise HTTPException(409, str(exc)) from None


@router.post("/{plan_id}/execute")
def execute(plan_id: str, kmend: KmendDep, who: OperatorDep, dry_run: bool = False) -> dict[str, Any]:
    """Run a plan now (awaiting approval, blocked, failed or dry-run); with dry_run=true only say what would run."""
    try:
        plan, preview = kmend.healing.execute(plan_id, who, kmend.set_incident_state, dry_run=dry_run)
    except KeyError:
        raise HTTPException(404, f"no plan {plan_id!r}") from None
    except NotAllowed as exc:
        raise HTTPException(409, str(exc)) from None
    return {"dry_run": dry_run, "would": preview, "plan": plan_to_dict(plan)}
