"""Shared fixtures: a real PostgreSQL server for the store tests, the shipped rules, a served app."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from analyzer.rules import Rule, default_rules_dir, load_rules

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long tests (real trainers, real servers) first, so they overlap the quick ones instead of running one after
    another at the end of the run. The order within each group is kept."""
    def weight(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("realjob") else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=weight)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def shipped_rules() -> list[Rule]:
    """Every rule pack in rules/, through the real loader."""
    return load_rules([default_rules_dir()])


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of a real PostgreSQL server: KMEND_TEST_POSTGRES_URL, or a private one started here."""
    if url := os.environ.get("KMEND_TEST_POSTGRES_URL"):
        yield url
        return
    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
        pytest.skip("PostgreSQL is not installed here (apt-get install postgresql)")
    tmp = Path(tempfile.mkdtemp(prefix="kmend-pg-"))
    data = tmp / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        pw = pwd.getpwnam("postgres")
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                    "--no-sync"], check=True, capture_output=True)
    log = tmp / "pg.log"
    subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-o",
                    f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def fresh_postgres_url(postgres_url: str) -> Iterator[str]:
    """A new empty database on the server, dropped afterwards."""
    import psycopg

    name = f"kmend_test_{os.getpid()}_{int(time.monotonic_ns() % 10**9)}"
    admin = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kmend.db'}"
    url: str = request.getfixturevalue("fresh_postgres_url")
    return url
