"""Recovery figures on a 1,024-node simulated cluster. Prints one JSON object per result.

- recovery: seconds from the incident (an Xid 79 on one node of a 256-node, 2,048-GPU job) to the restarted
  job's pods all bound to healthy nodes plus a spare — quarantine, drain, spare swap, checkpoint discovery and
  publication, gang restart through the PyTorchJob. Pod start, the job's own checkpoint write (drain grace)
  and checkpoint load are excluded: simulated pods end and bind at once.
- leaf_quarantine: seconds from 32 Xid 79s (a whole leaf) to all 32 nodes cordoned and tainted.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import zipfile
from pathlib import Path

import yaml

from collector.signal import LogLine, Signal, Source
from healer.notify import LogNotifier
from healer.policy_file import default_policy_path
from healer.records import StepKind, StepState
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.faults import KernelLog
from sim.world import JobSpec, SimWorld

NODES = 1024
NODES_PER_LEAF = 32


def _setup(tmp: Path, name: str, job_nodes: int) -> tuple[SimWorld, object]:
    policy = yaml.safe_load(default_policy_path().read_text())
    policy["defaults"]["drain_grace_s"] = 0
    (tmp / "policy.yaml").write_text(yaml.safe_dump(policy))
    ck = tmp / "ck" / "checkpoint-1200"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "trainer_state.json").write_text('{"global_step": 1200}')
    with zipfile.ZipFile(ck / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", b"weights")
    world = SimWorld(nodes=NODES, spares=32, nodes_per_leaf=NODES_PER_LEAF,
                     job=JobSpec("llama-405b", job_nodes, checkpoint_path=str(tmp / "ck")) if job_nodes else None)
    # The control plane mounts the checkpoint volume (KMEND_CHECKPOINT_ROOTS): without it, discovery is asked
    # of the node agent of a running pod of the job, and no agent runs here.
    settings = Settings(database_url=f"sqlite:///{tmp / (name + '.db')}", cluster="sim",
                        policy_file=tmp / "policy.yaml", symptom_settle_s=0, checkpoint_roots=[tmp / "ck"])
    kmend = make_kmend(settings, cluster=world.cluster, workloads=world.workloads, notifier=LogNotifier())
    kmend.start()
    return world, kmend


def recovery(tmp: Path) -> dict[str, object]:
    world, kmend = _setup(tmp, "recovery", 256)
    bad = "gpu-node-0130"
    line = LogLine("iteration 1200 | elapsed time per iteration (ms): 5400.1", namespace="training",
                   pod="llama-405b-worker-130", container="trainer", job="llama-405b", rank=1040)
    t0 = time.perf_counter()
    kmend.ingest([Signal(f"{bad}/container/0", bad, Source.CONTAINER, 1.7e9, line),  # type: ignore[attr-defined]
                  *KernelLog(bad, 1.7e9 - 3600).xid(1.7e9 + 1, 3, 79)])
    done = None
    while time.perf_counter() - t0 < 60:
        for plan in kmend.heal_once():  # type: ignore[attr-defined]
            step = next(s for s in plan.steps if s.kind is StepKind.RESTART_JOB)
            if step.state is StepState.SUCCEEDED:
                done = plan
        if done:
            break
    seconds = time.perf_counter() - t0
    if done is None:
        plans = [(p.id, p.state.value, [(s.kind.value, s.state.value, s.result) for s in p.steps if s.result])
                 for p in kmend.store.list_plans()]  # type: ignore[attr-defined]
        raise SystemExit(f"no restarted job within 60 s: {plans}")
    spare = done.outputs()["spare"]
    pods = world.workloads.list_pods(namespace="training")
    on_spare = sum(p.node == spare for p in pods)
    return {"bench": "recovery", "nodes": NODES, "job_nodes": 256, "job_gpus": 2048, "seconds": round(seconds, 3),
            "target_s": 10, "spare": spare, "pods_bound": sum(bool(p.node) for p in pods), "pods_on_spare": on_spare,
            "bad_node_pods": sum(p.node == bad for p in pods), "resume_from": done.outputs()["resume_from"],
            "excludes": "pod start, drain grace (the job's own checkpoint write), checkpoint load"}


def leaf_quarantine(tmp: Path) -> dict[str, object]:
    world, kmend = _setup(tmp, "leaf", 0)
    leaf = [f"gpu-node-{i:04d}" for i in range(5 * NODES_PER_LEAF, 6 * NODES_PER_LEAF)]
    t0 = time.perf_counter()
    kmend.ingest([s for n in leaf for s in KernelLog(n, 1.7e9 - 3600).xid(1.7e9, 0, 79)])  # type: ignore[attr-defined]
    while time.perf_counter() - t0 < 60:
        kmend.heal_once()  # type: ignore[attr-defined]
        nodes = {n.name: n for n in world.cluster.list_nodes()}
        if all(nodes[x].unschedulable and nodes[x].taint("kmend.io/fault") for x in leaf):
            break
    seconds = time.perf_counter() - t0
    return {"bench": "leaf_quarantine", "nodes": NODES, "quarantined": len(leaf), "seconds": round(seconds, 3),
            "target_s": 2, "breaker_tripped": kmend.healing.breaker().tripped}  # type: ignore[attr-defined]


def main() -> None:
    logging.getLogger("kmend").setLevel(logging.ERROR)  # notifications go to the log; keep stdout JSON only
    with tempfile.TemporaryDirectory() as tmp:
        for fn in (recovery, leaf_quarantine):
            d = Path(tmp) / fn.__name__
            d.mkdir()
            print(json.dumps(fn(d)), flush=True)


if __name__ == "__main__":
    main()
