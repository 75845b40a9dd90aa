"""Which policy rule an incident gets and why: the facts rules match on, every rule considered, evidence waits.

Pure: an incident and a policy in, an explanation out. ``kmend policy explain`` prints one; the healer
uses the same functions to choose, so what the explanation says is what the healer does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from analyzer.correlate import narrowing
from analyzer.records import Incident
from healer.policy_file import Facts, PolicyFile, Rule, mismatch
from healer.records import Mode


@dataclass(frozen=True, slots=True)
class RuleVerdict:
    """One rule as the choice saw it."""

    name: str
    """Rule name."""
    matched: bool
    """Whether its match held."""
    why: str
    """The field that failed, or what it picks."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """The choice for one incident."""

    facts: Facts
    """What the rules were matched against."""
    rule: Rule
    """The rule that applies (the fallback when none matched)."""
    mode: Mode
    """Its mode after the operator's opt-ins."""
    considered: tuple[RuleVerdict, ...] = field(default_factory=tuple)
    """Rules tried before (and including) the one that applies, in order."""
    evidence_wait: str | None = None
    """Why no plan is made yet (soft evidence that has not repeated or is stale), if so."""


def facts_of(incident: Incident, node_labels: Mapping[str, str] | None = None, job: str | None = None) -> Facts:
    """The facts of an incident; `job` is the job on the node now, when the cluster was asked."""
    root = incident.root_finding
    now_job = incident.root_cause.job if job is None else (job or None)
    return Facts(incident.fault_class, incident.severity, incident.hardware, incident.recommended_action,
                 dict(node_labels or {}), now_job, root.rule_id, narrowing(root) >= 2)


def evidence_wait(incident: Incident, rule: Rule, now: float) -> str | None:
    """Why the incident's evidence is not yet enough for `rule` (repeats and freshness), or None."""
    same = [f for f in incident.findings if f.fault_class is incident.fault_class]
    # A job-wide failure (hang, timeouts) is rooted in a symptom: its own findings are the evidence then.
    causes = [f for f in same if not f.is_symptom_class] or same
    if len(causes) < rule.min_findings:
        return (f"rule {rule.name!r} needs {rule.min_findings} {incident.fault_class.value} findings, "
                f"the incident has {len(causes)}: waiting for the evidence to repeat")
    if rule.fresh_s is not None and causes:
        age = now - max(f.ts for f in causes)
        if age > rule.fresh_s:
            return (f"rule {rule.name!r} needs evidence at most {rule.fresh_s:.0f} s old; the newest is "
                    f"{age:.0f} s old")
    return None


def explain(incident: Incident, policy: PolicyFile, now: float, node_labels: Mapping[str, str] | None = None,
            job: str | None = None) -> Explanation:
    """Every rule tried in order until one matches, with the reason each earlier one did not."""
    facts = facts_of(incident, node_labels, job)
    considered: list[RuleVerdict] = []
    chosen = policy.fallback
    for r in policy.rules:
        why = mismatch(r.match, facts)
        if why is None:
            considered.append(RuleVerdict(r.name, True, f"plan {r.plan}, mode {policy.mode_of(r).value}"))
            chosen = r
            break
        considered.append(RuleVerdict(r.name, False, why))
    return Explanation(facts, chosen, policy.mode_of(chosen), tuple(considered),
                       evidence_wait(incident, chosen, now))


def render(ex: Explanation, incident: Incident) -> str:
    """The explanation for people, one line per rule."""
    f = ex.facts
    lines = [f"incident {incident.id}: {f.fault_class.value} ({'hardware' if f.hardware else 'application'}), "
             f"recommends {f.action.value}, evidence {f.rule_id or '-'}"
             f"{', culprit named' if f.culprit else ''}, node {incident.root_cause.node or '-'}, "
             f"job {f.job or '-'}"]
    for v in ex.considered:
        lines.append(f"  {'MATCH ' if v.matched else 'reject'} {v.name}: {v.why}")
    if not any(v.matched for v in ex.considered):
        lines.append(f"  no rule matched: fallback {ex.rule.name} (plan {ex.rule.plan})")
    lines.append(f"=> rule {ex.rule.name!r}: plan {ex.rule.plan}, mode {ex.mode.value}"
                 + (f" (opted in: {ex.rule.opt_in.value})" if ex.rule.opt_in and ex.mode is not ex.rule.mode else ""))
    if ex.evidence_wait:
        lines.append(f"   no plan yet: {ex.evidence_wait}")
    return "\n".join(lines)
