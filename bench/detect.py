"""Detection benchmark on simulated multi-rank traces with ground truth; prints one JSON object.

    python bench/detect.py [--quick]

- hang: a silently hung rank (with GPU utilisation, or with progress reported
  before the gradient sync); detection delay against max(5 x median step, 30 s)
  and whether the culprit rank is named;
- straggler: one rank 1.05x-2x slower among 1,024; precision, recall within 50
  steps, steps to detect;
- root cause: lost GPU -> timeouts on every rank, silent hang (named by metrics,
  by progress, or by Flight Recorder dumps), a bug crashing every rank;
- false alarms: healthy jobs with jitter, per-rank speed spread, data-loader
  hiccups and checkpoint pauses, per 1,000 job-hours.

Everything runs through the real analyzer (rules, progress extraction, detectors,
correlator) in simulated time, evaluated once per simulated second.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding, Incident
from analyzer.rules import default_rules_dir, load_rules
from collector.signal import Source
from sim.traces import Batch, Straggle, TraceJob

RULES = load_rules([default_rules_dir()])
PROGRESS = load_progress_rules([default_progress_rules_dir()])


def analyzer() -> Analyzer:
    """A fresh analyzer with the shipped rules and default detector settings."""
    return Analyzer(RULES, correlator=Correlator(), detectors=DetectorSuite(PROGRESS))


def replay(an: Analyzer, batches: list[Batch], *, until: float | None = None, tick: float = 1.0) -> list[Finding]:
    """Feed batches in time order, evaluating the detectors every `tick` simulated seconds."""
    found: list[Finding] = []
    batches = sorted(batches, key=lambda b: b[0])
    t = batches[0][0]
    end = max(until or 0.0, batches[-1][0])
    i = 0
    while t <= end:
        while i < len(batches) and batches[i][0] <= t:
            f, _ = an.process(batches[i][1])
            found.extend(f)
            i += 1
        f, _ = an.evaluate(t)
        found.extend(f)
        t += tick
    return found


def bench_hang(trials: int, rng: random.Random) -> dict[str, Any]:
    delays, ratios, named, within = [], [], 0, 0
    for i in range(trials):
        step = rng.choice([0.5, 1.0, 2.0, 5.0, 10.0])
        behind = i % 2 == 0
        job = TraceJob(f"hang{i}", world=64, step_s=step, gpu_metrics=not behind, seed=i)
        batches = job.run(30)
        culprit = rng.randrange(job.world)
        batches += job.hang_rank(culprit, behind=behind, duration_s=max(20 * step, 120))
        # The delay counts from the job's last progress report (with a rank behind, the others' last step).
        stall_start = max(s.ts for _, sigs in batches for s in sigs if s.source is Source.PROGRESS)
        an = analyzer()
        found = replay(an, batches, until=stall_start + max(20 * step, 120))
        hang = [f for f in found if f.fault_class is FaultClass.HANG]
        target = max(5 * step, 30.0)
        if not hang:
            delays.append(float("inf"))
            continue
        d = hang[0].ts - stall_start
        delays.append(d)
        ratios.append(d / target)
        within += d <= target
        named += hang[0].where.rank == culprit
    finite = [d for d in delays if d != float("inf")]
    return {"trials": trials, "detected": len(finite), "within_target": within,
            "delay_s_median": round(statistics.median(finite), 1) if finite else None,
            "delay_s_max": round(max(finite), 1) if finite else None,
            "delay_over_target_max": round(max(ratios), 2) if ratios else None,
            "culprit_rank_named": named,
            "target": "max(5 x median step, 30 s)"}


def bench_straggler(factors: list[float], per_factor: int, world: int, rng: random.Random) -> dict[str, Any]:
    rows = []
    tp = fp = 0
    for factor in factors:
        found_steps = []
        for k in range(per_factor):
            job = TraceJob(f"s{factor}-{k}", world=world, step_s=1.0, seed=rng.randrange(10**6))
            slow = rng.randrange(world)
            warm = 10
            batches = job.run(warm) + job.run(50, straggle=Straggle(slow, factor, warm + 1))
            an = analyzer()
            for _, sigs in batches:
                an.process(sigs)
                for f in an.evaluate(job.ts)[0]:
                    if f.fault_class is not FaultClass.STRAGGLER:
                        continue
                    if f.where.rank == slow:
                        tp += 1
                        found_steps.append(int(f.fields["step"]) - warm)
                    else:
                        fp += 1
        rows.append({"slowdown": factor, "trials": per_factor, "found_within_50_steps": len(found_steps),
                     "steps_to_detect_median": statistics.median(found_steps) if found_steps else None,
                     "steps_to_detect_max": max(found_steps) if found_steps else None})
    trials = len(factors) * per_factor
    return {"world": world, "by_slowdown": rows, "true_findings": tp, "false_findings": fp,
            "precision": round(tp / (tp + fp), 4) if tp + fp else None,
            "recall_within_50_steps": round(tp / trials, 4)}


def _incident_of(incidents: list[Incident], rule_id: str) -> Incident | None:
    for inc in incidents:
        if any(f.rule_id == rule_id for f in inc.findings):
            return inc
    return None


def bench_root_cause(trials: int, rng: random.Random) -> dict[str, Any]:
    kinds = ["hardware", "hang-metrics", "hang-behind", "hang-flight-recorder", "app-bug"]
    right: dict[str, int] = dict.fromkeys(kinds, 0)
    for i in range(trials):
        kind = kinds[i % len(kinds)]
        step = rng.choice([1.0, 2.0, 5.0])
        job = TraceJob(f"rc{i}", world=64, step_s=step, gpu_metrics=kind == "hang-metrics", seed=i)
        batches = job.run(20)
        t = job.ts
        culprit = rng.randrange(job.world)
        an = analyzer()
        if kind == "hardware":
            lag = rng.uniform(0, 30)  # kernel logs can reach the service after the containers' lines
            ts, sigs = job.xid79(t + 0.5, culprit)
            batches += [(ts + lag, sigs), job.nccl_timeouts(t + 600, seq=4 * job.step + 1)]
        elif kind in ("hang-metrics", "hang-behind"):
            batches += job.hang_rank(culprit, behind=kind == "hang-behind", duration_s=120)
            batches.append(job.nccl_timeouts(t + 600, seq=4 * job.step + 1, skip=frozenset({culprit})))
        elif kind == "hang-flight-recorder":
            batches.append(job.nccl_timeouts(t + 600, seq=4 * job.step + 1, skip=frozenset({culprit})))
        else:
            batches.append(job.app_error(t + 0.5))
        replay(an, batches, until=t + 610)
        if kind == "hang-flight-recorder":
            for r, doc in job.flight_recorder_dumps(4 * job.step + 1, frozenset({culprit})).items():
                an.detectors.add_flight_recorder_dump(job.name, r, job.node_of(r), pickle.dumps(doc), t + 603)  # type: ignore[union-attr]
            an.evaluate(t + 620)
        incs = an.correlator.incidents()
        main = _incident_of(incs, "cuda-oom" if kind == "app-bug" else "nccl-watchdog-timeout")
        if main is None:
            continue
        rc = main.root_cause
        if kind == "app-bug":
            ok = not main.hardware and rc.node is None and main.fault_class is FaultClass.OOM_GPU and len(incs) == 1
        elif kind == "hardware":
            ok = main.hardware and rc.node == job.node_of(culprit) and len(incs) == 1
        else:
            ok = rc.node == job.node_of(culprit) and rc.rank == culprit and len(incs) == 1
        right[kind] += ok
    per = trials // len(kinds)
    return {"trials": trials, "right": sum(right.values()), "accuracy": round(sum(right.values()) / trials, 4),
            "by_scenario": {k: f"{v}/{per}" for k, v in right.items()}}


def bench_false_alarms(job_hours: float, rng: random.Random) -> dict[str, Any]:
    alarms: list[str] = []
    simulated = 0.0
    n = 0
    while simulated < job_hours * 3600:
        step = rng.choice([2.0, 5.0, 10.0, 20.0])
        job = TraceJob(f"healthy{n}", world=8, step_s=step, hiccup_p=0.002, seed=n)
        n += 1
        an = analyzer()
        start = job.ts
        hours = 4.0
        batches: list[Batch] = []
        while job.ts - start < hours * 3600:
            batches += job.run(int(1800 / step))  # 30 minutes of steps, then a checkpoint
            batches += job.pause(rng.uniform(30, 300))
            if rng.random() < 0.3:  # a data-loader stall on one rank well under the floor
                job.ts += rng.uniform(5, 15)
        for f in replay(an, batches, tick=5.0):
            alarms.append(f"{f.rule_id} {f.message}")
        simulated += job.ts - start
    hours_done = simulated / 3600
    return {"healthy_job_hours": round(hours_done, 1), "jobs": n, "ranks_per_job": 8,
            "false_alarms": len(alarms), "per_1000_job_hours": round(len(alarms) / hours_done * 1000, 2),
            "examples": alarms[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer trials (a smoke run)")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    q = args.quick
    t0 = time.monotonic()
    out = {
        "hang": bench_hang(10 if q else 40, rng),
        "straggler": bench_straggler([1.10] if q else [1.05, 1.10, 1.10, 1.20, 2.00], 2 if q else 4,
                                     256 if q else 1024, rng),
        "root_cause": bench_root_cause(10 if q else 100, rng),
        "false_alarms": bench_false_alarms(40 if q else 1000, rng),
    }
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
