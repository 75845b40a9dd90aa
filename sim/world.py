"""SimWorld: the simulated cluster (nodes and workloads), optionally kept in a file across process restarts.

With a state file, every change that takes effect is appended to an action log and the whole world is
rewritten atomically (temp file + rename) before the call returns — so a ``kill -9`` of the service leaves
exactly the changes the "API server" accepted, and the log shows how often each was applied. For crash
tests the world can kill its own process at the N-th change, either after persisting it (the call
succeeded, the caller never journaled the result) or before (the call never reached the server).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from healer.keys import CHECKPOINT_PATH
from healer.workloads import OwnerRef
from sim.cluster import SimCluster, build_cluster
from sim.workloads import SimWorkloads

PYTORCHJOB_API = "kubeflow.org/v1"
"""API version of Kubeflow's PyTorchJob."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A training job to place in a fresh simulated world."""

    name: str
    """Job (PyTorchJob) name."""
    nodes: int
    """Nodes it runs on, one pod of all the node's GPUs each."""
    namespace: str = "training"
    """Namespace."""
    checkpoint_path: str = ""
    """Value of its ``kmend.io/checkpoint-path`` annotation, if any."""


class SimWorld:
    """Nodes, workloads, and the log of every change applied to them."""

    def __init__(self, *, nodes: int = 16, gpus: int = 8, spares: int = 0, nodes_per_leaf: int = 8,
                 job: JobSpec | None = None, path: Path | None = None, crash_after: int | None = None,
                 crash_before: int | None = None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.crash_after = crash_after
        self.crash_before = crash_before
        self.actions: list[dict[str, Any]] = []
        """Every change that took effect: ``{"seq", "op", "target", "ts"}``."""
        self._changes = 0
        self._clock = clock
        self._loading = True
        self.cluster: SimCluster = build_cluster(nodes, gpus, nodes_per_leaf=nodes_per_leaf, spares=spares,
                                                 on_change=self._on_change)
        self.workloads = SimWorkloads(self.cluster, clock=clock, on_change=self._on_change)
        if path is not None and path.exists():
            self._load(path)
        elif job is not None:
            self.add_job(job)
        self._loading = False
        if path is not None and not path.exists():
            self._save()

    def add_job(self, job: JobSpec) -> None:
        """Place a PyTorchJob's pods on the first `job.nodes` schedulable nodes."""
        owner = OwnerRef(PYTORCHJOB_API, "PyTorchJob", job.name)
        names = [n.name for n in self.cluster.list_nodes() if not n.taints and not n.unschedulable][:job.nodes]
        ann = {CHECKPOINT_PATH: job.checkpoint_path} if job.checkpoint_path else {}
        for i, node in enumerate(names):
            gpus = self.cluster.gpus(node)
            self.workloads.add_pod(job.namespace, f"{job.name}-worker-{i}", node=node, gpus=gpus, owner=owner,
                                   annotations=ann, labels={"training.kubeflow.org/job-name": job.name,
                                                            "training.kubeflow.org/replica-index": str(i)})

    def applied(self, op: str | None = None) -> list[tuple[str, str]]:
        """(op, target) of every applied change, optionally of one operation."""
        return [(a["op"], a["target"]) for a in self.actions if op is None or a["op"].split(" ")[0] == op]

    # -- persistence --------------------------------------------------------------------------

    def _on_change(self, op: str, target: str) -> None:
        if self._loading:
            return
        self._changes += 1
        if self.crash_before is not None and self._changes == self.crash_before:
            os.kill(os.getpid(), signal.SIGKILL)  # the change never reaches the file: as if never applied
        self.actions.append({"seq": len(self.actions) + 1, "op": op, "target": target, "ts": self._clock()})
        if self.path is not None:
            self._save()
        if self.crash_after is not None and self._changes == self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)  # applied and durable; the caller never learns it

    def _save(self) -> None:
        assert self.path is not None
        with self.cluster.lock:
            state = {"cluster": self.cluster.to_json(), "workloads": self.workloads.to_json(),
                     "actions": self.actions}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)

    def _load(self, path: Path) -> None:
        state = json.loads(path.read_text())
        self.cluster.load_json(state["cluster"])
        self.workloads.load_json(state["workloads"])
        self.actions = list(state["actions"])


def read_actions(path: Path) -> list[dict[str, Any]]:
    """The action log of a file-backed world (for tests that run the service as a process)."""
    return list(json.loads(path.read_text())["actions"])
