"""Signal → cordon on the real API server that KMEND_TEST_KUBECONFIG names (used by bench/kube_path.py).

As tests/test_kube_serve_real.py deploys it: the shipped RBAC applied, kmend authenticated as the
`kmend-system/kmend` ServiceAccount with a token from TokenRequest. The bench creates its own Ready GPU nodes
(enough that the breaker never holds a fault back), sends one Xid 79 per node as an agent would, and takes the
time the cordon becomes visible from its own node watch (a real server has no hook on its clock); the floor is a
plain client's cordon PATCH until its answer, on the same server in the same run. The nodes are deleted after.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

GPU = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8", "pods": "110"}


def real_kubeconfig() -> str:
    """The real server's kubeconfig (admin credentials), or "" when none is named."""
    return os.environ.get("KMEND_TEST_KUBECONFIG", "")


def cordon_samples_real(faults: int, tmp: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    """Signal → cordon visible, ingest answer, a plain client's cordon round trip, and that cordon until the same
    watch sees it (the floor on the same yardstick as kmend's figure), in ms."""
    from kubernetes import client, config, watch

    from bench.kube_path import _kubeconfig, _stop, _wait, _xid, serve_kube
    from tests.test_kube_serve_real import _install

    admin = config.new_client_from_config(config_file=real_kubeconfig())
    core = client.CoreV1Api(admin)
    token = _install(admin, "kmend-bench")
    run = uuid.uuid4().hex[:4]
    names = [f"bench-{run}-{i}" for i in range(faults * 12)]
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch_cordons() -> None:
        w = watch.Watch()
        for ev in w.stream(core.list_node, label_selector=f"kmend.io/bench={run}", timeout_seconds=600):
            node = ev["object"]
            if node.spec.unschedulable:
                seen.setdefault(node.metadata.name, time.monotonic())
            if stop.is_set():
                w.stop()

    try:
        for name in names:
            core.create_node({"metadata": {"name": name, "labels": {"kmend.io/bench": run,
                                                                    "nvidia.com/gpu.present": "true"}}})
            core.patch_node_status(name, {"status": {"allocatable": GPU, "capacity": GPU, "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}]}})
            core.patch_node(name, {"spec": {"taints": []}})
        threading.Thread(target=watch_cordons, daemon=True).start()
        time.sleep(1.0)  # the watch is open before the first cordon
        floor, floor_seen = [], []
        for i in range(faults):
            node = names[i * 11 + 1]
            t0 = time.monotonic()
            core.patch_node(node, {"spec": {"unschedulable": True}})
            floor.append((time.monotonic() - t0) * 1000)
            _wait(lambda n=node: n in seen)
            floor_seen.append((seen[node] - t0) * 1000)
        cfg = admin.configuration
        kubeconfig = _kubeconfig(tmp, cfg.host, token, cfg.ssl_ca_cert)
        proc, url = serve_kube(kubeconfig, tmp)
        lat, ack = [], []
        try:
            with httpx.Client(base_url=url, headers={"authorization": "Bearer i"}, timeout=30) as agent:
                for i in range(faults):
                    node = names[i * 11]
                    t0 = time.monotonic()
                    agent.post("/v1/signals", json={"signals": [_xid(node)]}).raise_for_status()
                    ack.append((time.monotonic() - t0) * 1000)
                    _wait(lambda n=node: n in seen)
                    lat.append((seen[node] - t0) * 1000)
        finally:
            _stop(proc)
        return lat, ack, floor, floor_seen
    finally:
        stop.set()
        for name in names:
            with contextlib.suppress(client.ApiException):
                core.delete_node(name)
        admin.close()


def describe_real(kubeconfig: str) -> dict[str, Any]:
    """Which server the figures come from: its address and version."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=kubeconfig)
    try:
        version = client.VersionApi(api).get_code().git_version
        return {"server": f"real kube-apiserver {version} at {api.configuration.host}, RBAC enforced"}
    finally:
        api.close()
