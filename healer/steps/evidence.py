"""Evidence capture: the first step of any plan that changes a node or restarts a job.

What the plan acts on is written to the journal before anything destructive runs, so a person can
judge a plan after the node has been rebooted or replaced and its logs are gone.
"""

from __future__ import annotations

from healer.records import ActionStep, Plan
from healer.steps.base import StepContext, StepOutcome, done


def capture(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Keep the incident's evidence lines (and what the node agent attached) in the step's outputs."""
    p = step.params
    lines = [x for x in p.get("lines", "").split("\n") if x]
    out = {"lines": p.get("lines", ""), "signals": p.get("signals", ""), "captured_at": str(ctx.clock())}
    extra = []
    for key, what in (("nvidia_smi_q", "nvidia-smi -q output"), ("stack_dumps", "stack dumps")):
        if p.get(key):
            out[key] = p[key]
            extra.append(what)
    ladder = f"; ladder: {p['ladder']}" if p.get("ladder") else ""
    return done(f"kept {len(lines)} evidence line(s){' and ' + ', '.join(extra) if extra else ''} for incident "
                f"{p.get('incident', plan.incident_id)}{ladder}", **out)
