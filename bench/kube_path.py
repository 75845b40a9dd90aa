"""The healing path through a Kubernetes API server, as `kmend serve --cluster kube` runs it.

Server: the loopback API server of the tests (tests/fake_apiserver.py) with the shipped
ClusterRole enforced (keep-alive, as a real server; ``--tls`` puts it behind TLS with a throwaway
certificate); the official client; `kmend serve` as a child process with its shipped settings
(policy, breaker, rate limits, healer and scheduler intervals). Times come from the server's own
clock when it takes the write, not from a poll. Prints one JSON object per measurement:

- signal → cordon: an Xid 79 for one node POSTed to /v1/signals (one keep-alive client, as an
  agent), until the server takes the cordon PATCH; p50/p99 over N faults on N distinct nodes, one
  at a time; with the time to the ingest answer and, as the floor in the same run, a plain client's
  cordon PATCH on the same server.
- leaf quarantine: Xid 79 on every node of a 32-node leaf in one batch; seconds until every
  node the breaker lets through is cordoned, and how many it held back.
- binds: gang A (a PodGroup with minMember = N) pending before kmend starts: its first bind after
  start and after ready; gang B arriving while kmend runs: delay to its first bind, pods/s from its
  first bind to its last, kmend's CPU per pod; as the floor in the same run, a plain client binding
  the same number of pods one by one, and from 8 threads, on the same server.

``--serve-from DIR`` runs `kmend serve` from another source tree (an older checkout) against the
same server, to compare on the same machine; ``--compare DIR`` measures signal → cordon of this tree and of DIR
in alternating rounds of one run and prints their ratio; ``--write-ms MS`` makes each write on the fake take that
long, as on a real server; ``KMEND_BENCH_PROFILE=DIR`` runs it under py-spy.

These are figures against the loopback fake, not a real kube-apiserver: its per-request cost is
lower, so they bound kmend's own overhead rather than predict a production cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubernetes import client  # noqa: E402

from bench.kube_real import cordon_samples_real, describe_real, real_kubeconfig  # noqa: E402
from collector.wire import to_wire  # noqa: E402
from tests.builders import kernel  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.fake_apiserver import FakeApiServer, RoleRules  # noqa: E402
from tests.procs import wait_ready  # noqa: E402

NODE = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8", "pods": "110"}
TOKEN = "sa-token"
OPTIONS: dict[str, Any] = {"tls": False, "serve_from": "", "write_ms": 0.0}
"""--tls, --serve-from and --write-ms, as parsed."""
PROFILE = os.environ.get("KMEND_BENCH_PROFILE", "")
"""A folder: when set, `kmend serve` runs under py-spy and each measurement leaves its samples there."""


def _xid(node: str) -> dict[str, Any]:
    return to_wire(kernel(node, "[ 8123.450001] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.",
                          ts=time.time()))


def _cluster(api: FakeApiServer, nodes: int) -> None:
    for i in range(nodes):
        name = f"gpu-{i:04d}"
        api.add_node(name, {"topology.kmend.io/leaf": f"leaf-{i // 32}", "topology.kmend.io/spine": "spine-0"})
        api.nodes[name]["status"]["allocatable"] = dict(NODE)


def _describe() -> str:
    what = "loopback fake, RBAC enforced" + (", TLS" if OPTIONS["tls"] else "") + (
        f", {OPTIONS['write_ms']:g} ms per write" if OPTIONS["write_ms"] else "")
    return what + (f"; kmend from {OPTIONS['serve_from']}" if OPTIONS["serve_from"] else "")


def _server(rbac: RoleRules, tmp: Path) -> FakeApiServer:
    """The loopback API server, behind TLS with a throwaway certificate when --tls asks for it (a real server is)."""
    api = FakeApiServer(rbac=rbac)
    if OPTIONS["write_ms"]:
        # Each write takes as long as on a real server (etcd's commit, admission): the fake answers in microseconds.
        handle, delay = api.handle, OPTIONS["write_ms"] / 1000
        slowed = threading.Event()  # set once the cluster is built: kmend's writes pay, the setup does not
        api.slowed = slowed  # type: ignore[attr-defined]

        def slow(method: str, path: str, body: Any, ctype: str,
                 query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            if method in ("POST", "PUT", "PATCH", "DELETE") and slowed.is_set():
                time.sleep(delay)
            return handle(method, path, body, ctype, query)

        api.handle = slow  # type: ignore[method-assign]
    if OPTIONS["tls"]:
        cert, key = tmp / "tls.crt", tmp / "tls.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        # Handshakes in each connection's own thread, not in the one that accepts.
        api.httpd.socket = ctx.wrap_socket(api.httpd.socket, server_side=True, do_handshake_on_connect=False)
        api.url = api.url.replace("http://", "https://")
        api.ca = str(cert)  # type: ignore[attr-defined]
    return api


def _client(api: FakeApiServer) -> client.CoreV1Api:
    cfg = client.Configuration(host=api.url)
    cfg.api_key = {"authorization": f"Bearer {TOKEN}"}
    cfg.ssl_ca_cert = getattr(api, "ca", None)
    return client.CoreV1Api(client.ApiClient(cfg))


def _serve(api: FakeApiServer, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    return serve_kube(_kubeconfig(tmp, api.url, TOKEN, getattr(api, "ca", None)), tmp)


def _kubeconfig(tmp: Path, server: str, token: str, ca: str | None) -> Path:
    kubeconfig = tmp / "kubeconfig"
    cluster: dict[str, str] = {"server": server}
    if ca:
        cluster["certificate-authority"] = ca
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "f",
        "clusters": [{"name": "f", "cluster": cluster}],
        "users": [{"name": "k", "user": {"token": token}}],
        "contexts": [{"name": "f", "context": {"cluster": "f", "user": "k"}}]}))
    return kubeconfig


def serve_kube(kubeconfig: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`kmend serve --cluster kube` (from --serve-from's tree, or this one) on ``kubeconfig``; its process and URL."""
    port = free_port()
    env = {**os.environ, "KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig), "KMEND_PORT": str(port),
           "KMEND_DATABASE_URL": f"sqlite:///{tmp / 'k.db'}", "KMEND_INGEST_TOKEN": "i", "KMEND_OPERATOR_TOKEN": "o",
           "KMEND_SYMPTOM_SETTLE_S": "0",
           "KMEND_EVENT_NAMESPACE": "kmend-system"}
    tree = OPTIONS["serve_from"] or str(REPO)
    env["PYTHONPATH"] = tree
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "kmend.cli", "serve"]
    if PROFILE:
        # Sampled by py-spy from its start: wall time of every thread, idle waits included.
        out = Path(PROFILE) / f"{tmp.name}.json"
        cmd = ["py-spy", "record", "--idle", "--threads", "--format", "speedscope", "--rate", "500", "-o", str(out),
               "--", *cmd]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log=log)
    return proc, url


def _post(url: str, signals: list[dict[str, Any]]) -> None:
    r = httpx.post(f"{url}/v1/signals", json={"signals": signals}, headers={"authorization": "Bearer i"}, timeout=30)
    r.raise_for_status()


def _wait(pred: Any, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.002)
    raise TimeoutError


def cordon_latency(faults: int, tmp: Path) -> dict[str, Any]:
    lat, ack, floor = _cordon_samples(faults, tmp)
    return {"bench": "signal_to_cordon", "faults": faults, "server": _describe(),
            **_percentiles("", lat), **_percentiles("ingest_ack_", ack), **_percentiles("floor_patch_", floor)}


def cordon_compare(faults: int, other: str, tmp: Path, rounds: int = 2, *, real: bool = False) -> dict[str, Any]:
    """Signal → cordon of this tree and of ``other`` (an older checkout), in alternating rounds of one run."""
    sample = cordon_samples_real if real else _cordon_samples
    samples: dict[str, list[float]] = {"this": [], "other": []}
    for r in range(rounds):
        for name, tree in (("this", ""), ("other", other)):
            OPTIONS["serve_from"] = tree
            t = tmp / f"{name}-{r}"
            t.mkdir(parents=True)
            samples[name] += sample(max(1, faults // rounds), t)[0]
    OPTIONS["serve_from"] = ""
    this, then = _percentiles("", samples["this"]), _percentiles("", samples["other"])
    return {"bench": "signal_to_cordon_compare", "faults_each": len(samples["this"]), "rounds": rounds,
            **(describe_real(real_kubeconfig()) if real else {"server": _describe()}), "other": other,
            **{f"this_{k}": v for k, v in this.items()},
            **{f"other_{k}": v for k, v in then.items()},
            "p50_ratio": round(this["p50_ms"] / then["p50_ms"], 2),
            "p99_ratio": round(this["p99_ms"] / then["p99_ms"], 2)}


def _cordon_samples(faults: int, tmp: Path) -> tuple[list[float], list[float], list[float]]:
    """Signal → cordon, ingest answer, and a plain client's cordon, in ms, for ``faults`` faults."""
    rbac = RoleRules.from_manifest(REPO / "deploy" / "service" / "kmend.yaml", "kmend", token=TOKEN,
                                   user="system:serviceaccount:kmend-system:kmend")
    with _server(rbac, tmp) as api:
        # Enough nodes that the breaker (10 % of GPU nodes) never stops one fault at a time.
        _cluster(api, faults * 12)
        getattr(api, "slowed", threading.Event()).set()
        cordoned = _cordon_clock(api)
        # The floor: the cordon alone, a plain client's PATCH on the same server, as the server sees it land.
        core = _client(api)
        floor = []
        for i in range(faults):
            node = f"gpu-{i * 11 + 1:04d}"
            t0 = time.monotonic()
            core.patch_node(node, {"spec": {"unschedulable": True}}, _preload_content=False).data  # noqa: B018
            floor.append((cordoned[node] - t0) * 1000)
        proc, url = _serve(api, tmp)
        lat, ack = [], []
        try:
            with httpx.Client(base_url=url, headers={"authorization": "Bearer i"}, timeout=30) as agent:
                for i in range(faults):
                    node = f"gpu-{i * 11:04d}"
                    t0 = time.monotonic()
                    agent.post("/v1/signals", json={"signals": [_xid(node)]}).raise_for_status()
                    ack.append((time.monotonic() - t0) * 1000)
                    _wait(lambda n=node: n in cordoned)
                    lat.append((cordoned[node] - t0) * 1000)
        finally:
            _stop(proc)
    return lat, ack, floor


def _percentiles(prefix: str, values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {f"{prefix}p50_ms": round(statistics.median(v), 1),
            f"{prefix}p99_ms": round(v[max(0, int(len(v) * 0.99) - 1)], 1), f"{prefix}max_ms": round(v[-1], 1)}


def _cordon_clock(api: FakeApiServer) -> dict[str, float]:
    """When the server took each node's first cordon (its own clock, not a poll)."""
    times: dict[str, float] = {}
    handle = api.handle

    def timed(method: str, path: str, body: Any, ctype: str, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        code, answer = handle(method, path, body, ctype, query)
        if (method == "PATCH" and path.startswith("/api/v1/nodes/") and code < 300
                and isinstance(body, dict) and (body.get("spec") or {}).get("unschedulable")):
            times.setdefault(path.rsplit("/", 1)[1], time.monotonic())
        return code, answer

    api.handle = timed  # type: ignore[method-assign]
    return times


def leaf_quarantine(tmp: Path, nodes: int = 512) -> dict[str, Any]:
    rbac = RoleRules.from_manifest(REPO / "deploy" / "service" / "kmend.yaml", "kmend", token=TOKEN,
                                   user="system:serviceaccount:kmend-system:kmend")
    with _server(rbac, tmp) as api:
        _cluster(api, nodes)
        proc, url = _serve(api, tmp)
        leaf = [f"gpu-{i:04d}" for i in range(32)]
        try:
            t0 = time.monotonic()
            _post(url, [_xid(n) for n in leaf])
            deadline = t0 + 60
            last = -1
            stable_since = time.monotonic()
            while time.monotonic() < deadline:
                done = sum(1 for n in leaf if api.nodes[n]["spec"].get("unschedulable"))
                if done != last:
                    last, stable_since, at = done, time.monotonic(), time.monotonic() - t0
                elif time.monotonic() - stable_since > 3.0:
                    break
                time.sleep(0.01)
        finally:
            _stop(proc)
    return {"bench": "leaf_quarantine", "leaf_nodes": 32, "cluster_nodes": nodes, "cordoned": last,
            "held_back_by_breaker": 32 - last, "seconds_to_last_cordon": round(at, 3)}


def binds(pods: int, tmp: Path) -> dict[str, Any]:
    rbac = RoleRules.from_manifest(REPO / "deploy" / "service" / "kmend.yaml", "kmend", token=TOKEN,
                                   user="system:serviceaccount:kmend-system:kmend")
    out: dict[str, Any] = {"bench": "gang_binds", "pods": pods, "server": _describe()}
    with _server(rbac, tmp) as api:
        _cluster(api, 2 * pods)
        api.install_crd("scheduling.x-k8s.io", "v1alpha1")
        bound = _bind_clock(api)
        # The floor: the same number of binds from a plain client, one call after another, then from 8
        # threads (kmend's bind workers); each rate is first to last bind as the server saw them.
        core = _client(api)

        def bind(ns: str, i: int) -> None:
            resp = core.create_namespaced_pod_binding(f"p-{i}", ns, client.V1Binding(
                metadata=client.V1ObjectMeta(name=f"p-{i}"),
                target=client.V1ObjectReference(api_version="v1", kind="Node", name=f"gpu-{i:04d}")),
                _preload_content=False)
            resp.data  # noqa: B018 - read to the end: the connection is reused, as client-go does

        for ns in ("floor", "floor8"):
            for i in range(pods):
                api.add_pod(ns, f"p-{i}", scheduler="other", requests={"nvidia.com/gpu": "8"})
        for i in range(pods):
            bind("floor", i)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: bind("floor8", i), range(pods)))
        out["floor_plain_client_pods_per_s"] = _rate(bound["floor"])
        out["floor_8_threads_pods_per_s"] = _rate(bound["floor8"])
        for key in [k for k in api.pods if k[0].startswith("floor")]:
            del api.pods[key]
        # Gang A is pending before kmend starts: how soon after start the first bind comes.
        _gang(api, "train-a", pods, 0)
        t_spawn = time.monotonic()
        proc, _url = _serve(api, tmp)
        t_ready = time.monotonic()
        try:
            pid = _children(proc.pid)[0] if PROFILE else proc.pid
            _wait(lambda: len(bound.get("train-a", ())) == pods)
            out["a_first_bind_after_start_s"] = round(bound["train-a"][0] - t_spawn, 3)
            out["a_first_bind_after_ready_s"] = round(bound["train-a"][0] - t_ready, 3)
            out["a_pods_per_s"] = _rate(bound["train-a"])
            # Gang B arrives while kmend runs: the steady state, with kmend's CPU from arrival to last bind.
            cpu0 = _cpu(pid)
            t_created = time.monotonic()
            _gang(api, "train-b", pods, pods)
            _wait(lambda: len(bound.get("train-b", ())) == pods)
            cpu = _cpu(pid) - cpu0
            out["b_first_bind_after_arrival_s"] = round(bound["train-b"][0] - t_created, 3)
            out["b_all_bound_after_arrival_s"] = round(bound["train-b"][-1] - t_created, 3)
            out["b_pods_per_s"] = _rate(bound["train-b"])
            out["b_cpu_ms_per_pod"] = round(cpu * 1000 / pods, 2)
        finally:
            _stop(proc)
    out["b_vs_floor"] = round(out["b_pods_per_s"] / out["floor_plain_client_pods_per_s"], 2)
    return out


def _gang(api: FakeApiServer, namespace: str, pods: int, first: int) -> None:
    # A PodGroup with minMember as a training job's has: the gang is placed once, whole, when its last pod exists.
    api.add_custom("scheduling.x-k8s.io", "v1alpha1", namespace, "g", {"minMember": pods})
    for i in range(first, first + pods):
        api.add_pod(namespace, f"g-{i}", scheduler="kmend", requests={"nvidia.com/gpu": "8"},
                    labels={"scheduling.x-k8s.io/pod-group": "g"})


def _bind_clock(api: FakeApiServer) -> dict[str, list[float]]:
    """When the server accepted each binding, per namespace (its own clock, not a poll)."""
    times: dict[str, list[float]] = {}
    handle = api.handle

    def timed(method: str, path: str, body: Any, ctype: str, query: dict[str, str]) -> tuple[int, dict[str, Any]]:
        code, answer = handle(method, path, body, ctype, query)
        if method == "POST" and path.endswith("/binding") and code < 300:
            times.setdefault(path.split("/")[4], []).append(time.monotonic())
        return code, answer

    api.handle = timed  # type: ignore[method-assign]
    return times


def _rate(times: list[float]) -> float:
    return round((len(times) - 1) / max(times[-1] - times[0], 1e-6), 1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for pid in _children(proc.pid) if PROFILE else ():
        os.kill(pid, 15)  # py-spy writes its samples once the process it follows has exited
    proc.terminate() if not PROFILE else None
    proc.wait(timeout=60)


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--pods", type=int, default=64)
    p.add_argument("--only", choices=("cordon", "leaf", "binds"), action="append",
                   help="run only these measurements (repeatable); all three by default")
    p.add_argument("--tls", action="store_true", help="serve the API over TLS, as a real server does")
    p.add_argument("--write-ms", type=float, default=0.0, metavar="MS",
                   help="the fake takes this long for each write, as a real server does (a few ms)")
    p.add_argument("--serve-from", default="", metavar="DIR",
                   help="run `kmend serve` from this source tree (an older checkout, to compare in one run)")
    p.add_argument("--real-faults", type=int, default=30,
                   help="faults on the real API server KMEND_TEST_KUBECONFIG names (each needs 12 nodes created)")
    p.add_argument("--compare", default="", metavar="DIR",
                   help="signal → cordon of this tree and of DIR in alternating rounds of one run, with ratios")
    args = p.parse_args()
    OPTIONS.update(tls=args.tls, serve_from=args.serve_from, write_ms=args.write_ms)
    real = bool(real_kubeconfig())
    if args.compare:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(cordon_compare(args.faults, args.compare, Path(d))), flush=True)
            if real:
                print(json.dumps(cordon_compare(args.real_faults, args.compare, Path(d) / "real", real=True)),
                      flush=True)
        return
    runs = {"cordon": lambda t: cordon_latency(args.faults, t), "leaf": leaf_quarantine,
            "binds": lambda t: binds(args.pods, t)}
    with tempfile.TemporaryDirectory() as d:
        for name, fn in runs.items():
            if args.only and name not in args.only:
                continue
            t = Path(d) / name
            t.mkdir()
            print(json.dumps(fn(t)), flush=True)
        if real and (not args.only or "cordon" in args.only):
            (Path(d) / "real").mkdir()
            lat, ack, floor, floor_seen = cordon_samples_real(args.real_faults, Path(d) / "real")
            print(json.dumps({"bench": "signal_to_cordon", "faults": args.real_faults,
                              **describe_real(real_kubeconfig()), **_percentiles("", lat),
                              **_percentiles("ingest_ack_", ack), **_percentiles("floor_patch_", floor),
                              **_percentiles("floor_patch_seen_", floor_seen)}), flush=True)


if __name__ == "__main__":
    main()
