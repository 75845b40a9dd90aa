"""Configuration mistakes end in one line naming the setting, its value and what is expected (exit 2), never a
traceback: bad environment values, an unreadable policy or token file, an unreachable database, a missing
kubeconfig, demo sizes that cannot work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port


def _kmend(args: list[str], env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "KMEND_DATABASE_URL": f"sqlite:///{tmp / 'k.db'}", **env}
    return subprocess.run([sys.executable, "-m", "kmend.cli", *args], env=full, cwd=tmp, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("args", "env", "expect"), [
    (["serve"], {"KMEND_POLICY_FILE": "/nonexistent/policy.yaml"},
     "KMEND_POLICY_FILE='/nonexistent/policy.yaml': /nonexistent/policy.yaml: cannot read"),
    (["serve"], {"KMEND_HANG_K": "abc"}, "KMEND_HANG_K='abc': input should be a valid number"),
    (["serve"], {"KMEND_DATABASE_URL": "postgresql+psycopg://kmend:s3cret@127.0.0.1:1/kmend"},
     "KMEND_DATABASE_URL='postgresql+psycopg://kmend:***@127.0.0.1:1/kmend': cannot use the database"),
    (["serve"], {"KMEND_REPLICATED": "true"}, "replicated needs a PostgreSQL database_url"),
    (["serve"], {"KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": "/nonexistent/kubeconfig"},
     "KMEND_KUBECONFIG='/nonexistent/kubeconfig'"),
    (["agent", "--no-nvml", "--kernel", "off"], {"KMEND_AGENT_BATCH_SIZE": "0"},
     "KMEND_AGENT_BATCH_SIZE='0': input should be greater than or equal to 1"),
    (["agent", "--no-nvml", "--kernel", "off", "--token-file", "/nonexistent/token"], {},
     "KMEND_AGENT_TOKEN_FILE='/nonexistent/token': cannot read the token"),
    (["demo", "--nodes", "4", "--job-nodes", "3"], {}, "--nodes 4 leaves no room for a 3-node job"),
])
def test_a_configuration_mistake_is_one_line_naming_the_setting(tmp_path: Path, args: list[str],
                                                                env: dict[str, str], expect: str) -> None:
    if args[0] == "serve":
        args = [*args, "--port", str(free_port())]
    r = _kmend(args, env, tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("kmend: configuration error: ") and expect in lines[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "s3cret" not in r.stderr  # the database password is never printed
