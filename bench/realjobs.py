"""False alarms on healthy real training jobs: what kmend raises while it watches them; prints one JSON object.

    python bench/realjobs.py [--jobs ddp hf lightning] [--seconds 60] [--load 0] [--runs 1] [--evidence DIR]

Each job is an unmodified trainer under torchrun on CPU (gloo), one pod per rank written as CRI log files, watched
by a real ``kmend agent`` and ``kmend serve`` as their own processes (the real-job tests' harness,
``tests/realjob.py``): a plain DDP loop on 4 ranks (``ddp``), a Hugging Face Trainer on 2 (``hf``), a Lightning
Trainer on 2 (``lightning``). Nothing is wrong with any of them, so everything kmend raises is false. Jobs run one at
a time, each with a fresh service, for `--seconds` after its first step line; `--load N` starts N busy loops
(unpinned) beside each job, as a noisy neighbour would. Reported per job: the steps its logs show (read with kmend's
own progress rules), the seconds watched, the machine's load, the incidents and findings kmend raised (any kind:
hang, straggler, fault); and the totals: false findings per job-hour over the job-hours watched. With `--evidence`,
each job leaves its pods' logs there as a node bundle (``kmend analyze`` replays it) with a JSON
file: the findings and every rank's step lines' arrival times (the CRI timestamps the agent reads), to find out why
a finding was drawn, or how near the detectors came to one.

Everything the bench starts (trainers, busy loops, service, agent) is stopped and its temporary directory removed
before it prints, also when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.progress_rules import ProgressKind, ProgressRule, default_progress_rules_dir, load_progress_rules
from collector.sources.cri import TimestampParser
from tests.realjob import NODE, Job, Kmend, running_kmend


@dataclass(frozen=True)
class Spec:
    """One healthy trainer as the real-job tests run it."""

    script: str
    world: int
    env: tuple[tuple[str, str], ...] = ()


SPECS = {
    "ddp": Spec("plain_ddp.py", 4),
    "hf": Spec("hf_trainer.py", 2),
    # Lightning draws its default (Rich) bar only on a terminal; a pod that wants it in its log says so.
    "lightning": Spec("lightning_trainer.py", 2, (("TTY_COMPATIBLE", "1"), ("TTY_INTERACTIVE", "1"))),
}
STEPS = 10_000_000
"""Steps each trainer is asked for: more than any watch sees, so no job ends inside its watch."""
START_S = 180.0
"""Longest wait for a job's first step line (imports and rendezvous on a loaded machine)."""


def _step_rules() -> list[ProgressRule]:
    rules = [r for r in load_progress_rules([default_progress_rules_dir()]) if r.kind is ProgressKind.STEP]
    return sorted(rules, key=lambda r: r.priority)


def _arrivals(text: str, rules: list[ProgressRule], parse: TimestampParser) -> list[tuple[int, int, float]]:
    """(epoch, step, CRI time) of each record of one pod's log that kmend's progress rules read a step from
    (a bar's redraws, separated by carriage returns, each count)."""
    out: list[tuple[int, int, float]] = []
    for record in text.split("\n"):
        head = record.split(" ", 3)
        if len(head) < 4:
            continue
        ts = parse(head[0])
        for part in head[3].split("\r"):
            for rule in rules:
                got = rule.extract(part)
                if got is not None and got.step is not None:
                    out.append((got.epoch or 0, got.step, ts or 0.0))
                    break
    return out


def _findings(k: Kmend) -> dict[str, float]:
    """Findings the service produced since it started, by fault class (its own counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    body = k.client.get("/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == "kmend_analyzer_findings_total" and s.value:
                cls = s.labels.get("fault_class", "?")
                out[cls] = out.get(cls, 0.0) + s.value
    return out


@contextlib.contextmanager
def _busy_loops(n: int) -> Iterator[list[int]]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def _summary(inc: dict[str, Any]) -> dict[str, Any]:
    return {"fault_class": inc["fault_class"], "root_cause": inc["root_cause"],
            "findings": [{"rule_id": f["rule_id"], "fault_class": f["fault_class"], "message": f["message"],
                          "fields": f.get("fields", {})} for f in inc["findings"]]}


def watch(name: str, seconds: float, load: int, run: int, rules: list[ProgressRule],
          evidence: Path | None) -> dict[str, Any]:
    """One healthy job watched for `seconds` after its first step line, with `load` busy loops beside it."""
    spec = SPECS[name]
    parse = TimestampParser()
    with tempfile.TemporaryDirectory(prefix="kmend-realjobs-") as tmp, running_kmend(Path(tmp)) as k, \
            _busy_loops(load):
        # torchrun's own temporary directories stay behind when its workers are killed: they go with the bench's.
        (job_tmp := Path(tmp) / "job-tmp").mkdir()
        job = Job(k.pods, f"{name}-ok-{run}", spec.script, steps=STEPS, world=spec.world,
                  env={**dict(spec.env), "TMPDIR": str(job_tmp)})
        try:
            deadline = time.monotonic() + START_S
            while not _arrivals(job.pods[0].text()[-20000:], rules, parse):
                if time.monotonic() > deadline or any(p.proc.poll() is not None for p in job.pods):
                    raise RuntimeError(f"{name}: no step line in {START_S:.0f} s\n{job.output()}")
                time.sleep(0.5)
            first = time.monotonic()
            load_seen = [os.getloadavg()[0]]
            while (left := first + seconds - time.monotonic()) > 0:
                time.sleep(min(5.0, left))
                load_seen.append(os.getloadavg()[0])
            watched = time.monotonic() - first
            ended = [p.name for p in job.pods if p.proc.poll() is not None]
            incidents = k.incidents()
            findings = _findings(k)
        finally:
            job.stop()
        arrivals = {p.name: _arrivals(p.text(), rules, parse) for p in job.pods}
        steps = max((len({(e, s) for e, s, _ in a}) for a in arrivals.values()), default=0)
        result: dict[str, Any] = {
            "job": name, "run": run, "world": spec.world, "load": load, "steps": steps,
            "seconds": round(watched, 1), "loadavg": [round(min(load_seen), 1), round(max(load_seen), 1)],
            "pods_ended_early": ended, "findings": {c: int(v) for c, v in findings.items()},
            "incidents": [_summary(i) for i in incidents],
        }
        if evidence is not None:
            # The pods' logs as a node bundle (`kmend analyze DIR` replays them) and the arrivals read from them.
            path = evidence / f"{name}-load{load}-run{run}"
            shutil.copytree(k.pods, path / NODE / "var" / "log" / "pods")
            (path / "result.json").write_text(json.dumps({**result, "arrivals": arrivals}))
            result["evidence"] = str(path)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="*", default=list(SPECS), choices=list(SPECS), help="trainers to run, in order")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds each job is watched after its first step")
    ap.add_argument("--load", type=int, default=0, help="busy loops beside each job")
    ap.add_argument("--runs", type=int, default=1, help="times each job is run")
    ap.add_argument("--evidence", type=Path, help="folder for each job's logs and arrivals")
    args = ap.parse_args()
    rules = _step_rules()
    t0 = time.monotonic()
    jobs = [watch(name, args.seconds, args.load, run, rules, args.evidence)
            for run in range(args.runs) for name in args.jobs]
    hours = sum(j["seconds"] for j in jobs) / 3600
    false = sum(sum(j["findings"].values()) for j in jobs)
    print(json.dumps({
        "jobs": jobs,
        "job_hours": round(hours, 4),
        "false_findings": false,
        "false_incidents": sum(len(j["incidents"]) for j in jobs),
        "false_findings_per_job_hour": round(false / hours, 2) if hours else None,
        "jobs_with_findings": sum(1 for j in jobs if j["findings"] or j["incidents"]),
        "load": args.load,
        "seconds": round(time.monotonic() - t0, 1),
    }))


if __name__ == "__main__":
    main()
