"""`kmend serve` children for end-to-end tests: starting one (its own port and log), pointing it at a loopback
API server, and waiting for it to be ready: long enough for a loaded CI machine, and failing at once, with the
child's log, when the child has died instead."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

READY_TIMEOUT_S = 180.0
"""A cold start takes about 2 s; a 2-core CI machine running other test workers can take far longer."""


def wait_ready(url: str, proc: subprocess.Popen[bytes], *, log: Path | None = None,
               timeout: float = READY_TIMEOUT_S) -> None:
    """Return once ``url/readyz`` answers 200; raise with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"kmend exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready within {timeout:.0f} s")


REPO = Path(__file__).resolve().parent.parent


@dataclass
class Served:
    """One `kmend serve` child process."""

    name: str
    """What the test calls it (its Lease identity, for replicas)."""
    proc: subprocess.Popen[bytes]
    """The child."""
    port: int
    """Its loopback port."""
    log: Path
    """Its stdout and stderr."""

    @property
    def url(self) -> str:
        """Its base URL."""
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Return once it answers ``/readyz``; raise with its log if it exits first."""
        wait_ready(self.url, self.proc, log=self.log, timeout=timeout)

    def tail(self, chars: int = 3000) -> str:
        """The end of its log."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """Terminate it (if still running) and wait for it to exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_serve(tmp_path: Path, name: str, env: Mapping[str, str]) -> Served:
    """Start `kmend serve` on a free loopback port with `env` over this process's environment (not waited for)."""
    from tests.conftest import free_port

    port = free_port()
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], cwd=REPO,
                                env={**os.environ, **env, "KMEND_PORT": str(port)}, stdout=fh,
                                stderr=subprocess.STDOUT)
    return Served(name, proc, port, log)


def replica_env(base: Mapping[str, str], database_url: str) -> dict[str, str]:
    """`base` for replicas sharing one PostgreSQL, with a short Lease so a takeover fits in a test."""
    return {**base, "KMEND_DATABASE_URL": database_url, "KMEND_REPLICATED": "true", "KMEND_LEASE_DURATION_S": "4"}


def start_replicas(tmp_path: Path, env: Mapping[str, str], procs: dict[str, Served],
                   names: Iterable[str] = ("r1", "r2")) -> None:
    """Start one `kmend serve` per name (its identity) into `procs` and wait until each is ready; the caller
    stops them (`stop_all`), also when one fails to start."""
    for name in names:
        procs[name] = start_serve(tmp_path, name, {**env, "KMEND_IDENTITY": name})
    for served in procs.values():
        served.wait_ready()


def lease_holder(api: Any, lease: tuple[str, str] = ("kmend-system", "kmend-healer")) -> str:
    """Who holds the healer's Lease on a loopback API server ('' when nobody)."""
    got = api.leases.get(lease)
    return str(got["spec"].get("holderIdentity") or "") if got else ""


def stop_all(served: Iterable[Served]) -> None:
    """Stop every child still running."""
    for s in served:
        s.stop()


def logs(served: Iterable[Served]) -> str:
    """Every child's log tail, headed by its name (for a failing assertion)."""
    return "\n".join(f"--- {s.name}\n{s.tail()}" for s in served)


def write_kubeconfig(path: Path, server: str, token: str = "t") -> Path:
    """A kubeconfig at `path` for `server` (plain HTTP on loopback) with a bearer token."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "kmend", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "kmend"}}]}))
    return path


def kube_serve_env(tmp_path: Path, api_url: str, token: str, *, drain_grace_s: int = 5) -> dict[str, str]:
    """Settings for `kmend serve --cluster kube` against a loopback API server: a kubeconfig with `token`, the
    default policy with a short drain grace, and fast healer and scheduler loops."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api_url, token)
    policy = yaml.safe_load((REPO / "healer" / "policies" / "default.yaml").read_text())
    policy["defaults"]["drain_grace_s"] = drain_grace_s
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    return {"KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig), "KMEND_EVENT_NAMESPACE": "kmend-system",
            "KMEND_POLICY_FILE": str(tmp_path / "policy.yaml"), "KMEND_HEALER_INTERVAL_S": "0.1",
            "KMEND_SCHEDULER_INTERVAL_S": "0.1", "KMEND_SYMPTOM_SETTLE_S": "0"}


ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
"""Debian's Alertmanager binary (.ci/run installs it), or None."""


@contextlib.contextmanager
def alertmanager(tmp_path: Path, config: dict[str, Any], port: int,
                 timeout: float = READY_TIMEOUT_S) -> Iterator[str]:
    """A real Alertmanager on 127.0.0.1:`port` with `config`; yields its URL once /-/ready answers."""
    assert ALERTMANAGER is not None
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config))
    log = tmp_path / "am.log"
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={cfg}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "alertmanager did not become ready"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
