"""Correlation with many open incidents: findings folded per second. Prints one JSON object.

A 1,000-node fleet (8 GPUs a node, jobs of 32 nodes) with `--open` incidents open — a month of
notify-only hardware faults (ECC, thermal, PCIe, NVLink, IB link flaps) spread over 30 days, the
last hour's among them — put back as a restart does (`restore`). Then `--findings` new findings
arrive in batches of 100, built from the shipped rules (their classes, actions and symptom sets):
hardware faults on random GPUs (a third of them repeats of an open fault), application errors,
and job-wide failures: an Xid 79 followed by an NCCL timeout on each of its job's 256 ranks.

Measured in the same run: the indexed correlator, and the same correlator comparing each finding
with every open incident (``index=False``, the old linear scan) on the first `--compare` findings.
Both must build the same incidents; the output says whether they did.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

from analyzer.correlate import Correlator
from analyzer.records import FaultClass, Finding, Incident, IncidentState, Location, TimelineEntry
from analyzer.rules import Rule, default_rules_dir, load_rules

NODES, GPUS, JOB_NODES, RANKS_PER_NODE = 1000, 8, 32, 8
T_END = 1_700_000_000.0
MONTH_S = 30 * 86400.0
QUIET_CLASSES = (FaultClass.GPU_MEMORY, FaultClass.GPU_THERMAL_POWER, FaultClass.PCIE, FaultClass.NVLINK,
                 FaultClass.NETWORK)


def _node(i: int) -> str:
    return f"gpu-node-{i % NODES:04d}"


def _job(node: int) -> str:
    return f"job-{node // JOB_NODES:03d}"


def _rule(rules: list[Rule], fc: FaultClass, *, symptom: bool = False) -> Rule:
    return next(r for r in rules if r.fault_class is fc and bool(r.symptom_of) is symptom
                and (symptom or r.hardware is not False or fc is FaultClass.APP_ERROR))


def _finding(rule: Rule, fid: str, ts: float, node: int, *, gpu: int | None = None, rank: int | None = None,
             job: bool = True) -> Finding:
    where = Location(node=_node(node), gpu=None if gpu is None else str(gpu), rank=rank,
                     job=_job(node) if job else None)
    return Finding(fid, ts, rule.fault_class, rule.severity, rule.hardware is not False, where, rule.id,
                   rule.recommended_action, (f"sig-{fid}",), symptom_of=rule.symptom_of)


def open_incidents(rules: list[Rule], n: int, rng: random.Random) -> list[Incident]:
    """`n` open notify-only hardware incidents: a month of them, one finding each."""
    out = []
    for i in range(n):
        rule = _rule(rules, QUIET_CLASSES[i % len(QUIET_CLASSES)])
        ts = T_END - MONTH_S + rng.random() * MONTH_S
        node = rng.randrange(NODES)
        f = _finding(rule, f"old-{i}", ts, node, gpu=rng.randrange(GPUS), job=False)
        out.append(Incident(id=f"inc-old-{i:05d}", fault_class=f.fault_class, severity=f.severity,
                            hardware=f.hardware, recommended_action=f.recommended_action, root_cause=f.where,
                            opened_at=ts, updated_at=ts, findings=(f,), state=IncidentState.OPEN,
                            timeline=(TimelineEntry(ts, f"opened by {f.rule_id} on {f.where.node}"),)))
    return out


def new_findings(rules: list[Rule], n: int, old: list[Incident], rng: random.Random) -> list[Finding]:
    """The last hour's findings: repeats of open faults, new faults, application errors, job-wide failures."""
    xid79 = _rule(rules, FaultClass.GPU_LOST)
    app = _rule(rules, FaultClass.APP_ERROR)
    nccl = _rule(rules, FaultClass.NCCL_TIMEOUT, symptom=True)
    out: list[Finding] = []
    k = 0
    while len(out) < n:
        ts = T_END + len(out) * 3600.0 / n
        k += 1
        roll = rng.random()
        if roll < 0.3:
            prev = rng.choice(old).findings[0]
            out.append(replace(prev, id=f"new-{k}", ts=ts, evidence=(f"sig-new-{k}",)))
        elif roll < 0.6:
            fc = QUIET_CLASSES[k % len(QUIET_CLASSES)]
            out.append(_finding(_rule(rules, fc), f"new-{k}", ts, rng.randrange(NODES), gpu=rng.randrange(GPUS),
                                job=False))
        elif roll < 0.9:
            node = rng.randrange(NODES)
            out.append(_finding(app, f"new-{k}", ts, node, rank=node % JOB_NODES * RANKS_PER_NODE))
        else:
            # A GPU falls off the bus, then every rank of its job times out: one incident rooted at the node.
            node = rng.randrange(NODES)
            out.append(_finding(xid79, f"new-{k}", ts, node, gpu=rng.randrange(GPUS), job=False))
            first = node // JOB_NODES * JOB_NODES
            for r in range(JOB_NODES * RANKS_PER_NODE):
                out.append(_finding(nccl, f"new-{k}-r{r}", ts + 1.0, first + r // RANKS_PER_NODE, rank=r))
    return out[:n]


def fold(corr: Correlator, old: list[Incident], findings: list[Finding], batch: int) -> tuple[float, list[Incident]]:
    """Restore the open incidents, learn placements, fold the findings; returns (seconds folding, incidents)."""
    for inc in old:
        corr.restore(inc)
    for node in range(NODES):
        corr.observe_placement(_job(node), _node(node), T_END)
    t = time.perf_counter()
    for i in range(0, len(findings), batch):
        corr.add_all(findings[i:i + batch])
    return time.perf_counter() - t, corr.incidents()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--open", type=int, default=10_000)
    ap.add_argument("--findings", type=int, default=50_000)
    ap.add_argument("--compare", type=int, default=2_000, help="findings folded by the linear scan (0: none)")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rules = load_rules([default_rules_dir()])
    old = open_incidents(rules, args.open, rng)
    findings = new_findings(rules, args.findings, old, rng)
    dt, incs = fold(Correlator(), old, findings, args.batch)
    out: dict[str, object] = {
        "bench": "correlate", "open_incidents": args.open, "findings": len(findings), "batch": args.batch,
        "seconds": round(dt, 3), "findings_per_s": round(len(findings) / dt),
        "incidents_after": len(incs), "open_after": sum(i.state is IncidentState.OPEN for i in incs),
    }
    if args.compare:
        part = findings[:args.compare]
        dt_fast, fast = fold(Correlator(), old, part, args.batch)
        dt_scan, scan = fold(Correlator(index=False), old, part, args.batch)
        out |= {"compare_findings": len(part), "indexed_findings_per_s": round(len(part) / dt_fast),
                "linear_scan_findings_per_s": round(len(part) / dt_scan), "speedup": round(dt_scan / dt_fast, 1),
                "same_incidents": fast == scan}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
