"""Detection benchmark on simulated multi-rank traces with ground truth; prints one JSON object.

    python bench/detect.py [--quick]

- hang: a silently hung rank (ranks behind, or every rank stalled at the same step);
  delay from the job's last progress report against the target: 15 s for steps
  up to 2 s, max(3 x median step, 15 s) above;
- culprit: all-stalled hangs (every rank logged the same last step), each with one
  kind of evidence: the waiting ranks' collective-timeout lines (gloo or the NCCL
  watchdog), Flight Recorder dumps, GPU utilisation, or py-spy stacks (real dumps
  of a real gloo job, tests/fixtures/stacks); whether the incident names the rank;
- straggler: one rank 1.05x-2x slower among N; precision, recall within 30 steps;
- straggler_fast_lines: a job printing a step line every 50 ms, one rank's lines late, through the agent's
  default 5 s windows cut every 16 steps, against windows closed by time only (same jobs);
- root cause: lost GPU -> timeouts on every rank, silent hang (named by metrics,
  by progress, or by Flight Recorder dumps), a bug crashing every rank;
- lifecycle: jobs that finish (end-of-training line), are deleted (pods gone),
  restart from a checkpoint (pods replaced, steps go back), pause for checkpoints:
  hang findings (none is right); restarted jobs that hang again: detected;
- false alarms: healthy jobs of the kinds the real-job tests run and larger ones,
  with jitter, data-loader stalls, unannounced stalls, announced checkpoint and
  evaluation pauses, restarts, deletions and ends, per 10,000 job-hours: tens of
  thousands of job-hours judged at every moment a finding is possible
  (sim/healthy_fleet.py), and a smaller fleet replayed signal by signal.

Everything runs through the real analyzer (rules, progress extraction, detectors,
correlator) in simulated time, evaluated once per simulated second (every 5 s in
the false-alarm fleet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.correlate import Correlator
from analyzer.detectors.stacks import StackSample
from analyzer.detectors.suite import DetectorSuite
from analyzer.matcher import FastMatcher
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding, Incident
from analyzer.rules import default_rules_dir, load_rules
from bench.straggler_lines import bench_straggler_fast_lines
from collector.signal import Source
from sim.healthy_fleet import run_fleet
from sim.traces import Batch, Straggle, TraceJob

RULES = load_rules([default_rules_dir()])
PROGRESS = load_progress_rules([default_progress_rules_dir()])


def analyzer(matcher: FastMatcher | None = None) -> Analyzer:
    """A fresh analyzer with the shipped rules and default detector settings (`matcher`: one compiled before)."""
    return Analyzer(RULES, correlator=Correlator(), detectors=DetectorSuite(PROGRESS), matcher=matcher)


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


def hang_target(step: float) -> float:
    """Seconds after the last progress by which a hang must be found (issue targets; Mycroft reports 15 s)."""
    return 15.0 if step <= 2.0 else max(3 * step, 15.0)


def _median_step(batches: list[Batch]) -> float:
    """The job's real median step: rank 0's intervals between reports (compute, the slowest rank, the sync)."""
    ts = sorted(s.ts for _, sigs in batches for s in sigs
                if s.source is Source.PROGRESS and getattr(s.payload, "rank", None) == 0)
    return statistics.median(b - a for a, b in itertools.pairwise(ts))


def bench_hang(trials: int, rng: random.Random) -> dict[str, Any]:
    delays, ratios, named, within, behind_n, early = [], [], 0, 0, 0, 0
    for i in range(trials):
        step = rng.choice([0.5, 1.0, 2.0, 5.0, 10.0, 30.0])
        behind = i % 2 == 0
        job = TraceJob(f"hang{i}", world=64, step_s=step, gpu_metrics=not behind, seed=i, hiccup_p=0.002,
                       hiccup_s=(0.5, 5.0))
        batches = job.run(30)
        culprit = rng.randrange(job.world)
        batches += job.hang_rank(culprit, behind=behind, duration_s=max(20 * step, 120))
        # The delay counts from the job's last progress report (with a rank behind, the others' last step).
        stall_start = max(s.ts for _, sigs in batches for s in sigs if s.source is Source.PROGRESS)
        an = analyzer()
        found = replay(an, batches, until=stall_start + max(20 * step, 120))
        early += sum(1 for f in found if f.fault_class is FaultClass.HANG and f.ts < stall_start)
        hang = [f for f in found if f.fault_class is FaultClass.HANG and f.ts >= stall_start]
        target = hang_target(_median_step(batches))
        if not hang:
            delays.append(float("inf"))
            continue
        d = hang[0].ts - stall_start
        delays.append(d)
        ratios.append(d / target)
        within += d <= target
        if behind:
            behind_n += 1
            named += hang[0].where.rank == culprit
    finite = [d for d in delays if d != float("inf")]
    return {"trials": trials, "detected": len(finite), "within_target": within,
            "delay_s_median": round(statistics.median(finite), 1) if finite else None,
            "delay_s_max": round(max(finite), 1) if finite else None,
            "delay_over_target_max": round(max(ratios), 2) if ratios else None,
            "ranks_behind_culprit_named": f"{named}/{behind_n}", "hangs_before_the_stall": early,
            "target": "15 s for median steps <= 2 s, else max(3 x median step, 15 s) (the job's measured median)",
            "simulated": "64 ranks, steps 0.5-30 s, 3% jitter, data-loader hiccups (0.2% of rank-steps, +0.5-5 s); "
                         "half ranks-behind, half all-stalled with GPU utilisation; evaluated every 1 s"}


STACKS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "stacks"


def bench_culprit(trials: int, rng: random.Random) -> dict[str, Any]:
    """All-stalled hangs with one kind of evidence each; is the culprit rank the incident's root cause?"""
    kinds = ["gloo-timeouts", "nccl-watchdog", "flight-recorder", "gpu-utilisation", "py-spy-stacks"]
    right = dict.fromkeys(kinds, 0)
    waiting, stuck = (STACKS / "waiting_in_all_reduce.txt").read_text(), (STACKS / "stuck_in_sleep.txt").read_text()
    for i in range(trials):
        kind = kinds[i % len(kinds)]
        step = rng.choice([0.5, 1.0, 2.0, 5.0])
        job = TraceJob(f"cu{i}", world=rng.choice([8, 16, 64]), step_s=step,
                       gpu_metrics=kind == "gpu-utilisation", seed=1000 + i)
        batches = job.run(25)
        t = job.ts
        culprit = rng.randrange(job.world)
        batches += job.hang_rank(culprit, behind=False, duration_s=120)
        if kind == "gloo-timeouts":
            batches.append(job.gloo_timeouts(t + 60, skip=frozenset({culprit})))
        elif kind == "nccl-watchdog":
            batches.append(job.nccl_timeouts(t + 600, seq=4 * job.step + 1, skip=frozenset({culprit})))
        an = analyzer()
        replay(an, batches, until=t + (610 if kind == "nccl-watchdog" else 70))
        det = an.detectors
        assert det is not None
        if kind == "flight-recorder":
            for r, doc in job.flight_recorder_dumps(4 * job.step + 1, frozenset({culprit})).items():
                det.add_flight_recorder_dump(job.name, r, job.node_of(r), pickle.dumps(doc), t + 71)
            an.evaluate(t + 90)
        elif kind == "py-spy-stacks":
            for r in range(job.world):
                det.add_stack(job.name, StackSample(rank=r, node=job.node_of(r), pid=1000 + r,
                                                    text=stuck if r == culprit else waiting), t + 72)
            an.evaluate(t + 90)
        hangs = [inc for inc in an.correlator.incidents() if inc.fault_class is FaultClass.HANG]
        right[kind] += len(hangs) == 1 and hangs[0].root_cause.rank == culprit
    per = trials // len(kinds)
    return {"trials": trials, "named": sum(right.values()), "rate": round(sum(right.values()) / trials, 4),
            "by_evidence": {k: f"{v}/{per}" for k, v in right.items()},
            "simulated": "8-64 ranks, every rank stalled at the same step; timeout lines from every rank but the "
                         "culprit, Flight Recorder dumps from every rank, utilisation per GPU, or real py-spy dumps "
                         "(waiting in all_reduce vs stuck in its own code)"}


def bench_straggler(factors: list[float], per_factor: int, world: int, rng: random.Random) -> dict[str, Any]:
    rows = []
    tp = fp = 0
    for factor in factors:
        found_steps = []
        for k in range(per_factor):
            job = TraceJob(f"s{factor}-{k}", world=world, step_s=1.0, seed=rng.randrange(10**6))
            slow = rng.randrange(world)
            warm = 10
            batches = job.run(warm) + job.run(30, straggle=Straggle(slow, factor, warm + 1))
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
        rows.append({"slowdown": factor, "trials": per_factor, "found_within_30_steps": len(found_steps),
                     "steps_to_detect_median": statistics.median(found_steps) if found_steps else None,
                     "steps_to_detect_max": max(found_steps) if found_steps else None})
    target = [r for r in rows if r["slowdown"] >= 1.2]
    tp12 = sum(r["found_within_30_steps"] for r in target)
    n12 = sum(r["trials"] for r in target)
    return {"world": world, "by_slowdown": rows, "true_findings": tp, "false_findings": fp,
            "precision": round(tp / (tp + fp), 4) if tp + fp else None,
            "recall_within_30_steps": round(tp / (len(factors) * per_factor), 4),
            "recall_within_30_steps_at_1_2x_or_more": round(tp12 / n12, 4) if n12 else None,
            "simulated": f"{world} ranks, 1 s steps, 3% jitter, 0.5% per-rank speed spread; one rank slowed from "
                         "step 11; false findings are any other rank named"}


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


def bench_lifecycle(trials: int, rng: random.Random) -> dict[str, Any]:
    """Jobs that end, are deleted, restart or pause: hang findings (none is right); restarted jobs that hang again."""
    kinds = ["finished", "deleted", "restarted", "checkpoint-pause", "restarted-then-hung"]
    wrong = dict.fromkeys(kinds[:-1], 0)
    caught, delays = 0, []
    for i in range(trials):
        kind = kinds[i % len(kinds)]
        step = rng.choice([0.5, 1.0, 2.0, 5.0, 10.0])
        job = TraceJob(f"lc{i}", world=16, step_s=step, seed=2000 + i, hiccup_p=0.002, hiccup_s=(0.5, 5.0))
        batches = job.run(40)
        if kind == "finished":
            batches.append(job.finish())
        elif kind == "deleted":
            # kubectl delete: torchrun says it got SIGTERM, the pods go within the 30 s grace period.
            batches.append(job.terminated())
            batches.append(job.pods_gone(after_s=rng.uniform(1, 30)))
        elif kind == "checkpoint-pause":
            batches += job.pause(rng.uniform(60, 900))
            batches += job.run(20)
            batches.append(job.finish())
        else:
            # The job is replaced from its last checkpoint (10-30 steps back): pods deleted (torchrun
            # says so), new pods start and load it 1-3 minutes later.
            batches.append(job.terminated())
            batches.append(job.pods_gone(after_s=rng.uniform(1, 30)))
            job.resume_from(job.step - rng.randint(10, 30), after_s=rng.uniform(60, 180))
            batches += job.run(8)
            if kind == "restarted":
                batches.append(job.finish())
        if kind == "restarted-then-hung":
            culprit = rng.randrange(job.world)
            batches += job.hang_rank(culprit, behind=False, duration_s=120)
            last = max(s.ts for _, sigs in batches for s in sigs if s.source is Source.PROGRESS)
            found = [f for f in replay(analyzer(), batches, until=last + 120) if f.fault_class is FaultClass.HANG]
            late = [f for f in found if f.ts >= last]
            if late and len(late) == len(found):
                caught += 1
                delays.append(late[0].ts - last)
            continue
        until = job.ts + 900
        found = replay(analyzer(), batches, until=until)
        wrong[kind] += sum(1 for f in found if f.fault_class is FaultClass.HANG)
    per = trials // len(kinds)
    return {"trials": trials, "hang_findings": wrong, "restarted_then_hung_detected": f"{caught}/{per}",
            "restarted_then_hung_delay_s_max": round(max(delays), 1) if delays else None,
            "simulated": "16 ranks, steps 0.5-10 s, hiccups as in the fleet below; end line (Hugging Face final "
                         "metrics dict); deletion (torchrun's "
                         "SIGTERM line, pods removed 1-30 s later); pods replaced the same way and resumed 10-30 "
                         "steps back after 1-3 min; announced checkpoint of 1-15 min; watched for 15 min after"}


def bench_false_alarms(job_hours: float, rng: random.Random, jobs: int = 1) -> dict[str, Any]:
    """Healthy jobs judged by the real detectors at every moment a finding is possible (sim/healthy_fleet.py)."""
    seeds = [rng.randrange(10**9) for _ in range(max(jobs, 1))]
    t0, cpu0 = time.monotonic(), _cpu_s()
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            parts = list(pool.map(run_fleet, [job_hours / jobs] * jobs, seeds))
    else:
        parts = [run_fleet(job_hours, seeds[0])]
    cpu = _cpu_s() - cpu0
    hours = sum(p[0] for p in parts)
    # A stack-dump finding only follows a hang finding (the stacks of the stall it called) and joins its incident.
    alarms = [f for p in parts for f in p[2] if f.rule_id != "stack-dump"]
    held = sum(1 for p in parts for f in p[2] if f.fields.get("held_by_stacks"))
    seen: dict[str, int] = {}
    for p in parts:
        for k, v in p[3].items():
            seen[k] = seen.get(k, 0) + v
    return {"healthy_job_hours": round(hours, 1), "jobs": sum(p[1] for p in parts), "false_alarms": len(alarms),
            "per_10000_job_hours": round(len(alarms) / hours * 10000, 2),
            # With no alarm in N hours the 95 % upper bound of the rate is 3 / N (the rule of three).
            "upper_95_per_10000_job_hours": round(3.0 / hours * 10000, 2) if not alarms else None,
            "by_median_interval_s": _by_interval(alarms), "examples": [f.message for f in alarms[:3]],
            "alarms_after_a_hold": held,
            "judged": seen, "processes": len(parts), "wall_s": round(time.monotonic() - t0, 1),
            "cpu_s": round(cpu, 1),
            "simulated": "jobs of 1-8 h, the kinds the real-job tests run (DDP loop, 4 ranks, a line per 0.1 s "
                         "step; Hugging Face Trainer, 2 ranks, logging every 10 steps of 0.25 s; Lightning bar, 4 "
                         "ranks, 0.2 s; hook job with phases, 8 ranks, 1 s) and 8-rank jobs with 2/5/10/20 s steps; "
                         "3% jitter, data-loader stalls (0.2% of rank-steps, +0.5-5 s), an unannounced 1-6 s stall "
                         "in 30% of half-hours, announced checkpoints (every 30 min, 30-300 s) and evaluations "
                         "(hourly, 20-180 s), a restart from a checkpoint in 20% of jobs, 20% deleted, the rest "
                         "end with the end line; every silence a hang is possible in judged at its last instant, "
                         "every end 10 min after it; the stacks py-spy would show (sim/fleet_stacks.py) arrive "
                         "1-4 s after half the threshold"}


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the fleet's worker processes)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _by_interval(alarms: list[Finding]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in alarms:
        key = f.fields.get("median_interval_s", "?")
        key = f"{float(key):.1f}" if key != "?" else key
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def bench_false_alarms_replayed(job_hours: float, rng: random.Random, jobs: int = 1) -> dict[str, Any]:
    """The slower check: every signal through the whole analyzer, evaluated every 5 s (stragglers included)."""
    if jobs > 1:
        # Independent fleets on several cores (each its own seed), summed.
        seeds = [rng.randrange(10**9) for _ in range(jobs)]
        with ProcessPoolExecutor(jobs) as pool:
            parts = list(pool.map(_fleet, [job_hours / jobs] * jobs, seeds))
    else:
        parts = [_fleet(job_hours, rng.randrange(10**9))]
    hours_done = sum(p[0] for p in parts)
    alarms = [a for p in parts for a in p[2]]
    return {"healthy_job_hours": round(hours_done, 1), "jobs": sum(p[1] for p in parts), "ranks_per_job": 8,
            "false_alarms": len(alarms), "per_10000_job_hours": round(len(alarms) / hours_done * 10000, 2),
            "examples": alarms[:3], "fleets": len(parts),
            "simulated": "4 h jobs of 8 ranks, steps 1-20 s, 3% jitter, data-loader hiccups (0.2% of rank-steps, "
                         "+0.5-5 s), an unannounced 1-6 s stall in 30% of half-hours, an announced 30-300 s "
                         "checkpoint every 30 min, then the end line; evaluated every 5 s"}


def _fleet(job_hours: float, seed: int) -> tuple[float, int, list[str]]:
    rng = random.Random(seed)
    alarms: list[str] = []
    simulated = 0.0
    n = 0
    matcher = FastMatcher(RULES)  # log rules only (no metric state): compiled once, shared by the jobs
    while simulated < job_hours * 3600:
        step = rng.choice([1.0, 2.0, 5.0, 10.0, 20.0])
        job = TraceJob(f"healthy{seed}-{n}", world=8, step_s=step, hiccup_p=0.002, hiccup_s=(0.5, 5.0),
                       seed=rng.randrange(10**9))
        n += 1
        an = analyzer(matcher)
        start = job.ts
        hours = 4.0
        batches: list[Batch] = []
        while job.ts - start < hours * 3600:
            batches += job.run(int(1800 / step))  # 30 minutes of steps, then a checkpoint
            batches += job.pause(rng.uniform(30, 300))
            if rng.random() < 0.3:  # an unannounced stall (GC, a slow shard) well under the detection target
                job.ts += rng.uniform(1, 6)
        batches.append(job.finish())
        for f in replay(an, batches, until=job.ts + 600, tick=5.0):
            alarms.append(f"{f.rule_id} {f.message}")
        simulated += job.ts - start
    return simulated / 3600, n, alarms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer trials (a smoke run)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--fleet-hours", type=float, default=30000.0, help="healthy job-hours in the false-alarm fleet")
    ap.add_argument("--replayed-fleet-hours", type=float, default=40.0,
                    help="healthy job-hours replayed signal by signal through the whole analyzer")
    ap.add_argument("--jobs", type=int, default=2, help="processes for the false-alarm fleets")
    ap.add_argument("--straggler-world", type=int, default=1024, help="ranks per job in the straggler trials")
    ap.add_argument("--straggler-trials", type=int, default=10, help="straggler trials per slowdown")
    ap.add_argument("--straggler-slowdowns", type=float, nargs="*",
                    default=[1.05, 1.10, 1.20, 1.20, 1.50, 2.00], help="slowdowns of the straggler trials")
    ap.add_argument("--only", nargs="*", help="run only these sections")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    q = args.quick
    t0 = time.monotonic()
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "hang": lambda: bench_hang(12 if q else 60, rng),
        "culprit": lambda: bench_culprit(10 if q else 100, rng),
        "straggler": lambda: bench_straggler([1.20] if q else args.straggler_slowdowns,
                                             2 if q else args.straggler_trials, 256 if q else args.straggler_world,
                                             rng),
        "straggler_fast_lines": lambda: bench_straggler_fast_lines(4 if q else 20, 16, rng),
        "root_cause": lambda: bench_root_cause(10 if q else 100, rng),
        "lifecycle": lambda: bench_lifecycle(10 if q else 100, rng),
        "false_alarms": lambda: bench_false_alarms(1000 if q else args.fleet_hours, rng, args.jobs),
        "false_alarms_replayed": lambda: bench_false_alarms_replayed(8 if q else args.replayed_fleet_hours, rng,
                                                                     args.jobs),
    }
    out: dict[str, Any] = {name: run() for name, run in sections.items() if not args.only or name in args.only}
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
