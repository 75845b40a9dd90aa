"""Monitoring kmend: the PrometheusRule passes `promtool check rules` and its unit tests (`promtool test rules`),
every alert and dashboard query names metrics kmend really exports, the dashboard is what its generator makes,
and a real Prometheus scraping a real `kmend serve` evaluates every rule without error and sees a plan waiting
for approval."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from collector.metrics import AgentMetrics
from collector.wire import to_wire
from kmend.metrics import Metrics
from tests.builders import XID79, kernel
from tests.conftest import free_port
from tests.procs import wait_ready

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "deploy" / "monitoring"
CHART_FILES = REPO / "deploy" / "helm" / "kmend" / "files"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMTOOL is None or PROMETHEUS is None,
                                      reason="Debian's prometheus package is not installed (.ci/run installs it)")


def _rule_groups() -> list[dict[str, Any]]:
    doc = yaml.safe_load((MONITORING / "prometheus-rule.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def _exported_metrics() -> set[str]:
    names = set()
    for registry in (Metrics().registry, AgentMetrics().registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
    # Families that have not been observed yet still expose their names through describe().
    for registry in (Metrics().registry, AgentMetrics().registry):
        for collector in list(registry._collector_to_names):
            names.update(registry._collector_to_names[collector])
    return names


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bkmend_[a-z_]+\b", expr))


def test_every_alert_and_panel_reads_metrics_kmend_exports() -> None:
    exported = _exported_metrics()
    exprs = [r["expr"] for g in _rule_groups() for r in g["rules"]]
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    missing = {m for e in exprs for m in _metric_names(e)} - exported
    assert missing == set(), f"queries name metrics kmend does not export: {sorted(missing)}"
    assert len(exprs) > 25


def test_dashboard_and_its_configmap_are_what_the_generator_makes() -> None:
    pytest.importorskip("grafana_foundation_sdk")
    gen = runpy.run_path(str(REPO / "deploy" / "tools" / "gen_dashboard.py"))
    for name, text in gen["render"]().items():
        assert (CHART_FILES / name).read_text() == text, f"{name} is stale: run python deploy/tools/gen_dashboard.py"
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(refs)


@needs_prometheus
def test_alert_rules_pass_promtool_check_and_unit_tests(tmp_path: Path) -> None:
    rules = tmp_path / "kmend-rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": _rule_groups()}))
    checked = subprocess.run([str(PROMTOOL), "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    spec = yaml.safe_load((REPO / "tests" / "promtool" / "kmend-alerts-test.yaml").read_text())
    spec["rule_files"] = [str(rules)]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec))
    tested = subprocess.run([str(PROMTOOL), "test", "rules", str(tmp_path / "test.yaml")], capture_output=True,
                            text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}", "KMEND_CLUSTER": "sim",
           "KMEND_PORT": str(port), "KMEND_REQUIRE_APPROVAL": "true", "KMEND_SYMPTOM_SETTLE_S": "0",
           "KMEND_HEALER_INTERVAL_S": "0.1"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log=log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@needs_prometheus
@pytest.mark.slow
def test_real_prometheus_scrapes_kmend_and_evaluates_every_rule(tmp_path: Path, served: str) -> None:
    httpx.post(f"{served}/v1/signals", json={"signals": [to_wire(kernel("gpu-node-03", XID79))]}, timeout=10)
    rules = tmp_path / "kmend-rules.yaml"
    groups = _rule_groups()
    for g in groups:
        g["interval"] = "1s"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "kmend", "static_configs": [{"targets": [served.split("//")[1]]}]}]}))
    prom = subprocess.Popen([str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))  # noqa: SIM115
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 90
        waiting: list[Any] = []
        rule_health: list[tuple[str, str, str]] = []
        while time.monotonic() < deadline:
            time.sleep(1)
            try:
                query = 'sum(kmend_healer_plans_in_state{state="awaiting_approval"}) > 0'
                waiting = httpx.get(f"{api}/query", params={"query": query}, timeout=5).json()["data"]["result"]
                got = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
            except (httpx.HTTPError, KeyError, ValueError):
                continue
            rule_health = [(r["name"], r["health"], r.get("lastError", "")) for g in got for r in g["rules"]]
            if waiting and rule_health and all(h == "ok" for _, h, _ in rule_health):
                break
        assert waiting and float(waiting[0]["value"][1]) == 1.0, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert len(rule_health) == sum(len(g["rules"]) for g in groups)
        assert [r for r in rule_health if r[1] != "ok"] == []
        up = httpx.get(f"{api}/query", params={"query": 'up{job="kmend"}'}, timeout=5).json()["data"]["result"]
        assert up[0]["value"][1] == "1"
        # The service-down alert is silent while kmend is scraped.
        alerts = httpx.get(f"{api}/alerts", timeout=5).json()["data"]["alerts"]
        assert not [a for a in alerts if a["labels"]["alertname"] == "KmendServiceDown"]
    finally:
        prom.terminate()
        prom.wait(timeout=20)
