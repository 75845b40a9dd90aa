"""`kmend policy explain INCIDENT.json` and `kmend policy check [FILE]`: which rule an incident gets and why."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from analyzer.records import Action, FaultClass, Finding, Incident, Location, Severity
from healer.policy_explain import explain, render
from healer.policy_file import PolicyError, load_policy


class _Where(BaseModel):
    node: str | None = None
    gpu: str | None = None
    pci: str | None = None
    port: str | None = None
    rank: int | None = None
    job: str | None = None


class _Finding(_Where):
    """A finding as the API (``where``) or ``kmend analyze --format json`` (flat fields) prints it."""

    model_config = ConfigDict(extra="ignore")
    id: str = ""
    ts: float = 0.0
    fault_class: FaultClass
    severity: Severity = Severity.ERROR
    hardware: bool
    rule_id: str
    recommended_action: Action
    where: _Where | None = None
    evidence: list[str] = Field(default_factory=list)
    message: str = ""
    symptom_of: list[FaultClass] = Field(default_factory=list)
    fields: dict[str, str] = Field(default_factory=dict)

    def record(self, i: int) -> Finding:
        w = self.where or self
        return Finding(self.id or f"{self.rule_id}:{i}", self.ts, self.fault_class, self.severity, self.hardware,
                       Location(w.node, w.gpu, w.pci, w.port, w.rank, w.job), self.rule_id, self.recommended_action,
                       tuple(self.evidence), self.message, frozenset(self.symptom_of), self.fields)


class _Incident(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = "incident"
    fault_class: FaultClass
    hardware: bool
    recommended_action: Action
    root_cause: _Where = Field(default_factory=_Where)
    findings: list[_Finding] = Field(min_length=1)

    def record(self) -> Incident:
        fs = tuple(f.record(i) for i, f in enumerate(self.findings))
        rc = self.root_cause
        sev = max((f.severity for f in fs), key=list(Severity).index)
        return Incident(self.id, self.fault_class, sev, self.hardware, self.recommended_action,
                        Location(rc.node, rc.gpu, rc.pci, rc.port, rc.rank, rc.job), min(f.ts for f in fs),
                        max(f.ts for f in fs), fs, frozenset(f.where.job for f in fs if f.where.job))


def read_incidents(path: Path) -> list[Incident]:
    """Incidents from a file: one incident (``GET /v1/incidents/{id}``) or ``{"incidents": [...]}``."""
    try:
        data: Any = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    items = data.get("incidents") if isinstance(data, dict) and "incidents" in data else [data]
    out = []
    for i, item in enumerate(items or []):
        try:
            out.append(_Incident.model_validate(item).record())
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in e["loc"])
            raise ValueError(f"{path}: incidents.{i}.{where}: {e['msg']}") from None
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    p = sub.add_parser("policy", help="check the healing policy or explain its choice for an incident")
    verbs = p.add_subparsers(dest="verb", required=True)
    ex = verbs.add_parser("explain", help="which rule an incident gets, and why the earlier rules did not match")
    ex.add_argument("incident", type=Path, help="incident JSON (GET /v1/incidents/{id} or kmend analyze --format json)")
    ex.add_argument("--policy", type=Path, help="policy file (default: the shipped one)")
    ex.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE",
                    help="a label of the root-cause node (repeatable)")
    ex.add_argument("--now", type=float, help="time of the choice (default: the incident's last finding)")
    ex.set_defaults(func=run_explain)
    ck = verbs.add_parser("check", help="load a policy file and report errors (shadowed rules, unknown plans)")
    ck.add_argument("file", type=Path, nargs="?", help="policy file (default: the shipped one)")
    ck.set_defaults(func=run_check)


def run_explain(args: argparse.Namespace) -> int:
    """Print the explanation of every incident in the file."""
    try:
        policy = load_policy(args.policy)
        incidents = read_incidents(args.incident)
    except (PolicyError, ValueError) as exc:
        print(f"kmend policy explain: {exc}", file=sys.stderr)
        return 2
    labels = dict(kv.split("=", 1) for kv in args.node_label if "=" in kv)
    for inc in incidents:
        now = args.now if args.now is not None else inc.updated_at
        print(render(explain(inc, policy, now, labels), inc))
    return 0


def run_check(args: argparse.Namespace) -> int:
    """Load the policy through the real loader."""
    try:
        p = load_policy(args.file)
    except PolicyError as exc:
        print(f"kmend policy check: {exc}", file=sys.stderr)
        return 2
    print(f"{p.source}: {len(p.rules)} rules, {len(p.plans)} plans; ok")
    return 0
