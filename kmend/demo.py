"""`kmend demo`: a simulated cluster, a 64-rank job, an injected Xid 79, detected and healed live."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
import yaml

from collector.signal import Signal
from collector.wire import to_wire
from healer.keys import RESUME_FROM
from healer.notify import LogNotifier
from healer.policy_file import default_policy_path
from healer.workloads import ObjectKey
from kmend.app import create_app
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.faults import KernelLog
from sim.job import TrainingJob
from sim.world import PYTORCHJOB_API, JobSpec, SimWorld

Say = Callable[[str], None]


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="kmend-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the service did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _post(client: httpx.Client, signals: Sequence[Signal]) -> dict[str, Any]:
    resp = client.post("/v1/signals", json={"signals": [to_wire(s) for s in signals]})
    resp.raise_for_status()
    out: dict[str, Any] = resp.json()
    return out


JOB = "llama-70b-pretrain"


def write_checkpoints(root: Path) -> Path:
    """Hugging Face-style checkpoints: step 20 complete, step 40 cut short while writing (empty weights)."""
    for step, complete in ((20, True), (40, False)):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        weights = d / "pytorch_model.bin"
        if complete:
            with zipfile.ZipFile(weights, "w") as z:  # torch.save's zip layout
                z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        else:
            weights.write_bytes(b"")
    return root


def demo_policy(path: Path) -> Path:
    """The shipped policy with a short drain grace: the simulated job has nothing to flush."""
    data = yaml.safe_load(default_policy_path().read_text())
    data["defaults"]["drain_grace_s"] = 2
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_demo(*, nodes: int = 16, gpus: int = 8, job_nodes: int = 8, spares: int = 2, fault_node: int = 5,
             fault_gpu: int = 3, steps: int = 20, timeout_s: float = 45.0, say: Say = print,
             workdir: Path | None = None) -> dict[str, Any]:
    """Run the whole scenario; returns the summary printed by ``kmend demo --json``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kmend-demo-") as tmp:
        base = workdir or Path(tmp)
        ckpt = write_checkpoints(base / "checkpoints")
        settings = Settings(database_url=f"sqlite:///{base / 'kmend-demo.db'}", cluster="sim", sim_nodes=nodes,
                            sim_gpus_per_node=gpus, healer_interval_s=0.1, symptom_settle_s=5.0,
                            policy_file=demo_policy(base / "policy.yaml"), checkpoint_roots=[ckpt])
        world = SimWorld(nodes=nodes, gpus=gpus, spares=spares,
                         job=JobSpec(JOB, job_nodes, checkpoint_path=str(ckpt)))
        notifier = LogNotifier()
        logging.getLogger("kmend.notify").setLevel(logging.ERROR)  # the demo tells its own story
        kmend = make_kmend(settings, cluster=world.cluster, workloads=world.workloads, notifier=notifier)
        app = create_app(kmend, settings)
        names = [n.name for n in world.cluster.list_nodes()]
        job = TrainingJob(JOB, names[:job_nodes], ranks_per_node=gpus)
        bad = names[fault_node]
        t0 = time.time() - 3600
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            say(f"kmend serving on {url}; simulated cluster: {nodes} nodes x {gpus} GPUs, {spares} hot spares")
            say(f"job {job.name}: {job.world_size} ranks on {job_nodes} nodes, "
                f"{job.step_time_s:.1f} s/iteration, checkpoints under {ckpt}")
            for it in range(1, steps + 1):
                _post(client, job.step(it, t0 + it * job.step_time_s))
            say(f"  {steps} iterations logged by every rank ({steps * job.world_size} lines)")
            t_fault = t0 + (steps + 1) * job.step_time_s
            klog = KernelLog(bad, boot_ts=t0 - 86400)
            _post(client, klog.xid(t_fault, fault_gpu, 79))
            say(f"injected: Xid 79 (GPU fallen off the bus) on {bad} GPU {fault_gpu}")
            _post(client, job.nccl_timeouts(t_fault + 600, seq=steps * 4 + 1))
            say(f"  600 s later every surviving rank reports an NCCL watchdog timeout "
                f"({job.world_size} lines)")
            # Run the detectors now rather than on the loop's next tick, so the summary is the same every run.
            hang = [f for f in kmend.evaluate().findings if f.fault_class.value == "hang"]
            if hang:
                say(f"  hang detector: {hang[0].message}")
            quarantined = _until(timeout_s, lambda: _quarantined(client, bad))
            if quarantined:
                say(f"quarantined: {bad} cordoned, tainted kmend.io/fault=gpu_lost:NoSchedule, "
                    "condition and Event set")
            request = _until(timeout_s, lambda: _pending_request(client, bad))
            for a in kmend.actions():
                if a["kind"] in ("drain", "spare_swap", "checkpoint", "restart_job"):
                    say(f"  {a['kind']:<11} {a['detail']}")
            if request:
                say(f"the platform reports {bad} {request['kind']}d; kmend validates it and returns it to the pool")
                client.post(f"/v1/nodes/{bad}/requests/{request['id']}",
                            json={"state": "done", "message": "node replaced by the platform"})
            healed = _until(timeout_s, lambda: _plans_done(client)) is not None
            summary = _summary(client, kmend.actions(), healed, time.monotonic() - started)
            summary["job"] = _job_view(world, bad, set(names[nodes - spares:]))
            summary["notifications"] = [str(n.get("message", "")) for n in notifier.sent]
        kmend.store.close()
    if healed:
        say(f"healed in {summary['seconds']:.1f} s: {JOB} runs again on {len(summary['job']['nodes'])} healthy "
            f"nodes (spare {summary['job']['spare'] or '-'} in place of {bad}), resuming from "
            f"{summary['job']['resume_from'] or 'scratch'}")
    else:
        say(f"NOT healed within {timeout_s:.0f} s")
    return summary


T = TypeVar("T")


def _until(timeout_s: float, probe: Callable[[], T | None]) -> T | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    return None


def _quarantined(client: httpx.Client, node: str) -> bool:
    n = client.get("/v1/nodes").json()["nodes"][node]
    return bool(n["cordoned"] and n["fault"])


def _pending_request(client: httpx.Client, node: str) -> dict[str, Any] | None:
    reqs: list[dict[str, Any]] = client.get(f"/v1/nodes/{node}/requests").json()["requests"]
    # The platform answers repairs; stack dumps and GPU reports are the node agent's (there is none in the demo).
    repairs = [r for r in reqs if r["kind"] in ("replace", "reboot", "reset_gpu")]
    return repairs[0] if repairs else None


def _plans_done(client: httpx.Client) -> bool:
    plans = client.get("/v1/plans").json()["plans"]
    done = bool(plans) and all(p["state"] in ("succeeded", "failed", "rejected", "dry_run") for p in plans) \
        and any(p["state"] == "succeeded" and p["policy"] != "notify" for p in plans)
    # A plan's last step runs in the background; the healer's next round settles its incident and node.
    return done and all(n["state"] in ("healthy", "spare") for n in client.get("/v1/nodes").json()["nodes"].values())


def _job_view(world: SimWorld, bad: str, spares: set[str]) -> dict[str, Any]:
    """Where the job's ranks run now, which spare took the failed node's place, and the resume point."""
    job_pods = [p for p in world.workloads.list_pods(namespace="training")
                if p.labels.get("training.kubeflow.org/job-name") == JOB and not p.terminating]
    nodes = sorted({p.node for p in job_pods if p.node})
    owner = world.workloads.get_object(ObjectKey(PYTORCHJOB_API, "PyTorchJob", "training", JOB))
    return {
        "pods": {p.name: p.node for p in sorted(job_pods, key=lambda p: p.name)},
        "nodes": nodes,
        "on_failed_node": bad in nodes,
        "spare": next((n for n in nodes if n in spares), None),
        "resume_from": (owner or {}).get("metadata", {}).get("annotations", {}).get(RESUME_FROM, ""),
    }


def _summary(client: httpx.Client, actions: list[dict[str, Any]], healed: bool, seconds: float) -> dict[str, Any]:
    incidents = []
    for inc in client.get("/v1/incidents").json()["incidents"]:
        full = client.get(f"/v1/incidents/{inc['id']}").json()
        incidents.append({
            "id": full["id"], "state": full["state"], "fault_class": full["fault_class"],
            "hardware": full["hardware"], "recommended_action": full["recommended_action"],
            "root_cause": full["root_cause"], "jobs": full["jobs"], "finding_count": len(full["findings"]),
            "findings_by_rule": _tally(f["rule_id"] for f in full["findings"]),
        })
    nodes = client.get("/v1/nodes").json()["nodes"]
    states = _tally(n["state"] for n in nodes.values())
    return {
        "healed": healed,
        "seconds": round(seconds, 2),
        "incidents": incidents,
        "actions": actions,
        "nodes": {"total": len(nodes), "by_state": states,
                  "unhealthy": {k: v for k, v in nodes.items() if v["state"] != "healthy"}},
    }


def _tally(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def print_human(summary: dict[str, Any], say: Say = print) -> None:
    """The end-of-demo summary, for people."""
    say("")
    say(f"incidents: {len(summary['incidents'])}")
    for inc in summary["incidents"]:
        rc = inc["root_cause"]
        say(f"  {inc['id']}  {inc['fault_class']:<13} hardware={inc['hardware']!s:<5} "
            f"action={inc['recommended_action']:<13} root cause: node={rc['node']} pci={rc['pci']} "
            f"job={rc['job']}  ({inc['finding_count']} findings: {inc['findings_by_rule']})")
    say("actions:")
    for a in summary["actions"]:
        say(f"  {a['kind']:<11} {a['node'] or '-':<14} {a['result']:<9} {a['detail']}")
    if summary.get("notifications"):
        say("notifications sent:")
        for n in summary["notifications"]:
            say(f"  {n}")
    say(f"nodes: {summary['nodes']['by_state']}")
