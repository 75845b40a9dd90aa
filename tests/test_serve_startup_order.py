"""`kmend serve` start-up puts the gang scheduler first: with a current schema it loads neither Alembic nor the node
agent's modules; a schema behind head is still upgraded; on a real cluster a gang waiting at start is bound while
the rest of the service is still being built (here: while the database does not answer at all), its first bind loads
neither the metrics client, the web stack nor the store, and it comes within a small multiple of the time the bare
client takes to import (measured in the same run)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kmend.store import Store
from kmend.store.schema import head_revision
from tests.conftest import free_port
from tests.fake_apiserver import FakeApiServer
from tests.procs import write_kubeconfig

REPO = Path(__file__).resolve().parent.parent
COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1")

# `kmend serve` as the console script runs it, stopped where uvicorn would start serving.
PROBE = """
import sys, uvicorn
def serve(app, **kw):
    print(sorted(m for m in ("alembic", "kmend.commands.agent", "collector.agent") if m in sys.modules))
uvicorn.run = serve
from kmend.cli import main
sys.exit(main(["serve", "--cluster", "sim", "--port", "0", "--database-url", sys.argv[1]]))
"""


def _serve_modules(url: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, url], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_serve_on_a_current_schema_loads_neither_alembic_nor_the_agent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    # The first start creates the schema: Alembic is needed then.
    assert _serve_modules(url) == "['alembic']"
    assert Store(url).revision() == head_revision()
    # Every later start finds it current with one query (Alembic's import and scripts: a third of a second).
    assert _serve_modules(url) == "[]"


def test_a_schema_behind_head_is_still_upgraded(tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config

    url = f"sqlite:///{tmp_path / 'k.db'}"
    cfg = Config()
    cfg.set_main_option("script_location", str(REPO / "kmend" / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url)
    command.upgrade(cfg, "0006")
    store = Store(url)
    assert store.revision() == "0006"
    store.migrate()
    assert store.revision() == head_revision() != "0006"
    store.close()


def _silent_database() -> tuple[socket.socket, threading.Event]:
    """A port that accepts connections and never answers: the store's first query waits on it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    done = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue
        for conn in held:
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return listener, done


def _pending_gang(api: FakeApiServer, *, nodes: int, pods: int) -> None:
    """`nodes` free 8-GPU nodes and one PodGroup of `pods` 8-GPU pods waiting for kmend's scheduler."""
    api.install_crd(*COSCHEDULING)
    for i in range(nodes):
        api.add_node(f"n{i}")
        api.nodes[f"n{i}"]["status"]["allocatable"] = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8",
                                                     "pods": "110"}
    api.add_custom(*COSCHEDULING, "t", "g", {"minMember": pods})
    for i in range(pods):
        api.add_pod("t", f"g-{i}", scheduler="kmend", requests={"nvidia.com/gpu": "8"},
                    labels={"scheduling.x-k8s.io/pod-group": "g"})


def test_a_gang_waiting_at_start_is_bound_before_the_service_is_built(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        _pending_gang(api, nodes=8, pods=4)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        listener, done = _silent_database()
        port = listener.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO), "KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig),
               "KMEND_PORT": str(free_port()),
               "KMEND_DATABASE_URL": f"postgresql+psycopg://kmend@127.0.0.1:{port}/kmend?connect_timeout=600"}
        log = tmp_path / "serve.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, cwd=REPO, stdout=fh,
                                    stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120  # generous for a loaded machine
            while time.monotonic() < deadline and proc.poll() is None and not all(
                    api.pods[("t", f"g-{i}")]["spec"].get("nodeName") for i in range(4)):
                time.sleep(0.05)
            assert all(api.pods[("t", f"g-{i}")]["spec"].get("nodeName") for i in range(4)), \
                log.read_text(errors="replace")[-3000:]
            # Placed while the store had not answered a single query: the service was not built yet.
            assert proc.poll() is None
            assert ("kmend-system", "kmend-healer") in api.leases  # it leads: the Lease was taken first
        finally:
            proc.terminate()
            proc.wait(30)
            done.set()
            listener.close()



def test_the_lease_taken_before_the_store_exists_is_recorded_once_it_does(tmp_path: Path) -> None:
    from sqlalchemy import select

    from kmend.early import start_early
    from kmend.settings import Settings
    from kmend.store import schema
    from kmend.wiring import make_kmend

    with FakeApiServer() as api:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        settings = Settings(cluster="kube", kubeconfig=str(kubeconfig), identity="kmend-a",
                            database_url=f"sqlite:///{tmp_path / 'k.db'}")
        early = start_early(settings)
        assert early is not None and early.loop is not None
        try:
            deadline = time.monotonic() + 60
            while not early.leader.is_leader() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert early.leader.is_leader()  # taken while there is no schema yet
            kmend = make_kmend(settings, early=early)
            kmend.start()
            with kmend.store.engine.connect() as conn:
                rows = conn.execute(select(schema.leases_seen.c.name, schema.leases_seen.c.holder)).all()
            assert [tuple(r) for r in rows] == [("kmend-healer", "kmend-a")]
            kmend.store.close()
        finally:
            early.loop.stop()


# `kmend serve --cluster kube` as the console script runs it, ended at its first binding: which of the modules that
# the first bind does not need were loaded before it.
FIRST_BIND_PROBE = """
import os, sys
import healer.kube.pods as pods
def bind(self, *args, **kwargs):
    # One write: binds are issued concurrently, and two threads' prints could interleave on one line.
    os.write(1, (repr(sorted(m for m in sys.argv[1].split(",") if m in sys.modules)) + "\\n").encode())
    os._exit(0)
pods.KubePodScheduling.bind = bind
from kmend.cli import main
main(["serve"])
"""
NOT_BEFORE_THE_FIRST_BIND = ("prometheus_client", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic",
                             "pandas", "sklearn", "kmend.service", "kmend.app", "healer.kube.workloads")
"""What a gang waiting at start does not wait for: the metrics client (a tenth of a second to import on a loaded
machine; the scheduler's first cycles are counted once it is loaded), the web stack, the store, the service."""


def test_the_first_bind_loads_neither_the_metrics_client_nor_the_web_stack_or_store(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        _pending_gang(api, nodes=8, pods=4)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        env = {**os.environ, "PYTHONPATH": str(REPO), "KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig),
               "KMEND_PORT": str(free_port()), "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"}
        out = subprocess.run([sys.executable, "-c", FIRST_BIND_PROBE, ",".join(NOT_BEFORE_THE_FIRST_BIND)], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_scheduler_cycles_before_the_metrics_exist_are_counted() -> None:
    from prometheus_client import CollectorRegistry

    from healer.gang.metrics import HeldMetrics, SchedulerMetrics

    held = HeldMetrics()
    held.observe(0.02, 0, placed=1, bound=16)  # the first cycle, before the registry exists
    held.failed_binds(2)
    registry = CollectorRegistry()
    held.attach(SchedulerMetrics(registry))
    held.observe(0.01, 1, placed=0, bound=0)  # a later one goes straight through
    assert registry.get_sample_value("kmend_scheduler_pods_bound_total") == 16
    assert registry.get_sample_value("kmend_scheduler_gangs_placed_total") == 1
    assert registry.get_sample_value("kmend_scheduler_bind_failures_total") == 2
    assert registry.get_sample_value("kmend_scheduler_cycle_duration_seconds_count") == 2
    assert registry.get_sample_value("kmend_scheduler_gangs_pending") == 1


FIRST_BIND_FLOOR_RATIO = 2.0
"""First bind after `kmend serve` starts, in units of `python -c 'import kubernetes'` measured just before: a process
that must at least import the client. kmend takes 1.2-1.9 of them (0.39-0.51 s), where it took 2.4-3.9 (0.78-1.05 s)
when it built the generated API classes first and ran the rest of start-up beside the first cycle."""


def _import_client_s() -> float:
    """Wall seconds of a process that imports the Kubernetes client and exits (the floor, in this run)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import kubernetes"], check=True, timeout=120)
    return time.monotonic() - t0


def _first_bind_after_start(api: FakeApiServer, tmp_path: Path, attempt: int) -> tuple[float, float]:
    """Seconds from spawning `kmend serve` to the API server taking its first binding, and the floor before it."""
    bound: list[float] = []
    handle = api.handle

    def timed(method: str, path: str, body: Any, ctype: str,
              query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        code, answer = handle(method, path, body, ctype, query)
        if method == "POST" and path.endswith("/binding") and code < 300:
            bound.append(time.monotonic())
        return code, answer

    api.handle = timed  # type: ignore[method-assign]
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    env = {**os.environ, "PYTHONPATH": str(REPO), "KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig),
           "KMEND_PORT": str(free_port()), "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / f'k{attempt}.db'}"}
    floor = _import_client_s()
    log = tmp_path / f"serve{attempt}.log"
    with open(log, "wb") as fh:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, cwd=REPO, stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        deadline = t0 + 120  # generous for a loaded machine; returns at the first bind
        while not bound and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert bound, log.read_text(errors="replace")[-3000:]
        return bound[0] - t0, floor
    finally:
        api.handle = handle  # type: ignore[method-assign]
        proc.terminate()
        proc.wait(30)


def test_a_gang_pending_at_start_is_bound_within_a_few_client_imports(tmp_path: Path) -> None:
    """16 pods of one gang wait when `kmend serve --cluster kube` starts. Their first bind must not wait for the
    generated client's API classes and models, the rule engines, or the rest of start-up running beside it."""
    tries: list[tuple[float, float]] = []
    for attempt in range(3):  # the best of three: a loaded machine slows one start, not the rule
        with FakeApiServer() as api:
            _pending_gang(api, nodes=32, pods=16)
            first, floor = _first_bind_after_start(api, tmp_path, attempt)
            tries.append((round(first, 3), round(floor, 3)))
            if first <= FIRST_BIND_FLOOR_RATIO * floor:
                return
    raise AssertionError(f"first bind after start vs `import kubernetes` (seconds), each try: {tries}; "
                         f"allowed {FIRST_BIND_FLOOR_RATIO}x")
