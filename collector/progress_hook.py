"""Progress hook for training scripts: ``report_step(step, step_time, phases=None)`` and ``finish()``.

Standard library only, so a training image needs nothing else (the file can also be
copied into a project as is). Each rank appends one JSON line per step to
``$KMEND_PROGRESS_DIR/<job>.rank<rank>.jsonl``; the node agent tails those files
(``collector.progress_file``). Without ``KMEND_PROGRESS_DIR`` the hook does nothing,
so a script can call it unconditionally. Writing never raises into the training loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

ENV_DIR = "KMEND_PROGRESS_DIR"
"""Directory the agent watches (a hostPath or emptyDir shared with the agent)."""
ENV_JOB = "KMEND_JOB"
"""Job name; without it the agent names the job after the pod (its labels or name), as for log lines."""
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""The pod's namespace, mounted with its service-account token."""


def launcher_env(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Where this process sits, as torchrun and Kubernetes tell it: recorded with every step.

    ``RANK`` is the global rank (eight processes in one pod are eight ranks); ``LOCAL_RANK`` and
    ``GROUP_RANK`` (the node's index) and ``TORCHELASTIC_RUN_ID`` say the same from the launcher's
    side; ``HOSTNAME`` is the pod's name, so the agent can give the samples the job of the pod's logs.
    """
    env = os.environ if environ is None else environ
    out: dict[str, object] = {}
    for key, name in (("LOCAL_RANK", "local_rank"), ("GROUP_RANK", "group_rank"), ("WORLD_SIZE", "world_size")):
        raw = env.get(key, "")
        if raw.isdigit():
            out[name] = int(raw)
    if env.get("TORCHELASTIC_RUN_ID"):
        out["run_id"] = env["TORCHELASTIC_RUN_ID"]
    namespace = env.get("POD_NAMESPACE")
    if not namespace:
        with contextlib.suppress(OSError):
            namespace = Path(SA_NAMESPACE).read_text().strip()
    # Only inside a pod is the host name the pod's name (on bare metal it names the machine).
    if namespace and env.get("HOSTNAME"):
        out["namespace"] = namespace
        out["pod"] = env["HOSTNAME"]
    return out


class ProgressReporter:
    """Appends step records for one rank; line-buffered so the agent sees each step at once."""

    def __init__(self, directory: str | os.PathLike[str], job: str, rank: int, *,
                 world_size: int | None = None) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.path = Path(directory) / f"{_safe(job)}.rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open across steps
        self._last = 0

    def report_step(self, step: int, step_time: float | None = None,
                    phases: Mapping[str, float] | None = None, *, ts: float | None = None) -> None:
        """Record that `step` finished, taking `step_time` seconds (phases: seconds per phase)."""
        rec = _record(time.time() if ts is None else ts, self.job, self.rank, step, step_time, phases)
        if self.world_size is not None:
            rec["world_size"] = self.world_size
        self._last = int(step)
        with contextlib.suppress(OSError):  # a full disk must not stop training
            self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def finish(self, step: int | None = None, *, ts: float | None = None) -> None:
        """Record that the run finished (after `step`, default the last reported): its silence is no hang."""
        if step is not None:
            self._last = int(step)
        rec = _record(time.time() if ts is None else ts, self.job, self.rank, self._last, None, None)
        rec["event"] = "end"
        with contextlib.suppress(OSError):
            self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


def _record(ts: float, job: str, rank: int, step: int, step_time: float | None,
            phases: Mapping[str, float] | None) -> dict[str, object]:
    rec: dict[str, object] = {"ts": ts, "job": job, "rank": rank, "step": int(step)}
    if step_time is not None:
        rec["step_time"] = float(step_time)
    if phases:
        rec["phases"] = {str(k): float(v) for k, v in phases.items()}
    return rec


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def report_step(step: int, step_time: float | None = None, phases: Mapping[str, float] | None = None) -> None:
    """Report one finished step of this rank (job, rank and directory from the environment).

    Opens, appends and closes the file each time: no state is kept in the module, and a
    step takes far longer than the append.
    """
    _append(step, step_time, phases, None)


def finish(step: int = 0) -> None:
    """Report that this rank's run finished normally (call after the last step).

    A job that stops reporting because it is done then raises no hang. `step` is the last
    step (0 when unknown: the detectors keep the last one they saw).
    """
    _append(step, None, None, "end")


def _append(step: int, step_time: float | None, phases: Mapping[str, float] | None, event: str | None) -> None:
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    named = os.environ.get(ENV_JOB)
    job = named or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
    rank = int(os.environ.get("RANK", "0"))
    rec = _record(time.time(), job, rank, step, step_time, phases)
    rec.update(launcher_env())
    if not named:
        rec["job_from_pod"] = True  # no explicit name: the agent uses the pod's job when it knows the pod
    if event:
        rec["event"] = event
    line = json.dumps(rec, separators=(",", ":")) + "\n"
    path = Path(directory) / f"{_safe(job)}.rank{rank}.jsonl"
    with contextlib.suppress(OSError):  # a full or missing disk must not stop training
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
