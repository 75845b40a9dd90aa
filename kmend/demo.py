"""`kmend demo`: a simulated cluster, a 64-rank job, an injected Xid 79, detected and healed live."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from collector.signal import Signal
from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from sim.faults import KernelLog
from sim.job import TrainingJob

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


def run_demo(*, nodes: int = 16, gpus: int = 8, job_nodes: int = 8, fault_node: int = 5, fault_gpu: int = 3,
             steps: int = 20, timeout_s: float = 30.0, say: Say = print, workdir: Path | None = None) -> dict[str, Any]:
    """Run the whole scenario; returns the summary printed by ``kmend demo --json``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kmend-demo-") as tmp:
        db = (workdir or Path(tmp)) / "kmend-demo.db"
        settings = Settings(database_url=f"sqlite:///{db}", cluster="sim", sim_nodes=nodes,
                            sim_gpus_per_node=gpus, healer_interval_s=0.1, symptom_settle_s=5.0)
        cluster = build_cluster(nodes, gpus)
        notifier = LogNotifier()
        kmend = make_kmend(settings, cluster=cluster, notifier=notifier)
        app = create_app(kmend, settings)
        names = [n.name for n in cluster.list_nodes()]
        job = TrainingJob("llama-70b-pretrain", names[:job_nodes], ranks_per_node=gpus)
        bad = names[fault_node]
        t0 = time.time() - 3600
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            say(f"kmend serving on {url}; simulated cluster: {nodes} nodes x {gpus} GPUs")
            say(f"job {job.name}: {job.world_size} ranks on {job_nodes} nodes, "
                f"{job.step_time_s:.1f} s/iteration")
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
            healed = _wait_for(client, bad, timeout_s)
            summary = _summary(client, kmend.actions(), healed, time.monotonic() - started)
        kmend.store.close()
    if healed:
        say(f"healed: {bad} cordoned and tainted in {summary['seconds']:.1f} s")
    else:
        say(f"NOT healed within {timeout_s:.0f} s")
    return summary


def _wait_for(client: httpx.Client, node: str, timeout_s: float) -> bool:
    """Until the node is quarantined and the plan that did it has finished."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = client.get("/v1/nodes").json()["nodes"][node]
        if n["cordoned"] and n["fault"] and all(
            client.get(f"/v1/incidents/{i}").json()["state"] == "remediating" for i in n["incidents"]
        ):
            return True
        time.sleep(0.1)
    return False


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
        say(f"  {a['kind']:<9} {a['node'] or '-':<14} {a['result']:<9} {a['detail']}")
    say(f"nodes: {summary['nodes']['by_state']}")
