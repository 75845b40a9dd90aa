"""Hot-spare swap: hand the closest healthy spare to the job whose node was quarantined."""

from __future__ import annotations

from healer.keys import SPARE_FOR, SPARE_LABEL, SPARE_PLAN, SPARE_TAINT_KEY
from healer.records import ActionStep, Plan
from healer.spares import pick_spare
from healer.steps.base import StepContext, StepOutcome, done, skipped


def spare_swap(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Claim a spare (annotated with the plan first, so a rerun after a crash finds the same one), then untaint it."""
    if not step.params.get("job"):
        return skipped("no job to hand a spare to")
    nodes = ctx.cluster.list_nodes()
    mine = next((n for n in nodes if n.annotations.get(SPARE_PLAN) == plan.id), None)
    if mine is None:
        mine = pick_spare(nodes, step.node or "", ctx.policy.topology_keys)
        if mine is None:
            return skipped("spare pool has no healthy spare; the job restarts on the remaining nodes")
    job = f"{step.params.get('namespace', '')}/{step.params.get('job', '')}"
    ctx.cluster.patch_node_metadata(mine.name, labels={SPARE_LABEL: "in-use"},
                                    annotations={SPARE_PLAN: plan.id, SPARE_FOR: job})
    ctx.cluster.remove_taint(mine.name, SPARE_TAINT_KEY)
    where = [f"{k.rsplit('/', 1)[-1]}={mine.labels.get(k, '?')}" for k in ctx.policy.topology_keys]
    return done(f"spare {mine.name} ({', '.join(where)}) handed to {job} in place of {step.node}", spare=mine.name)
