"""`kmend agent` settings and wiring: env and flags, sources built from fixture roots, bad rules refused."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kmend.cli import build_parser
from kmend.commands.agent import AgentSettings, build_agent, build_request_runner, settings_from
from kmend.errors import ConfigError
from tests.agent_helpers import FIXTURES, CriWriter


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["agent", *argv])


def test_node_from_downward_api_env_and_flags_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-07")
    monkeypatch.setenv("KMEND_AGENT_BATCH_SIZE", "250")
    monkeypatch.setenv("KMEND_AGENT_SERVICE_URL", "http://env:8080")
    s = settings_from(_args("--service-url", "http://flag:8080", "--no-prefilter"))
    assert (s.node, s.batch_size, s.service_url, s.prefilter) == ("gpu-node-07", 250, "http://flag:8080", False)
    assert settings_from(_args("--node", "other")).node == "other"


def test_token_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("abc\n")
    assert AgentSettings(node="n", token_file=tmp_path / "t").bearer() == "abc"
    assert AgentSettings(node="n").bearer() is None


def test_build_agent_wires_the_sources_it_can_use(tmp_path: Path) -> None:
    CriWriter(tmp_path / "pods").line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    settings = AgentSettings(node="n1", state_dir=tmp_path / "state", pods_root=tmp_path / "pods",
                             kernel="kmsg", kmsg_path=FIXTURES / "kmsg.txt", boot_id_path=tmp_path / "boot",
                             ib_root=FIXTURES / "ib", nvml=False, pod_labels=False,
                             service_url="http://127.0.0.1:9")
    agent = build_agent(settings)
    # py-spy is installed with kmend: the stack survey samples the node's rank processes now and then.
    assert [s.name for s in agent.sources] == ["container", "kernel", "processes", "stack-survey", "ib"]
    # Stack dumps, checkpoint searches (and GPU resets where NVML answers) are node requests, in their own thread.
    runner = build_request_runner(settings)
    assert runner is not None and {"stack_dump", "find_checkpoint"} <= set(runner.capabilities)
    polled = {s.name: s.poll() for s in agent.sources}
    # The prefilter from the shipped rules keeps the fault lines and drops the rest.
    assert len(polled["container"].signals) == 1
    assert [s.text for s in polled["kernel"].signals] == [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."]
    assert polled["ib"].signals


def test_missing_kmsg_device_is_logged_not_fatal(tmp_path: Path) -> None:
    settings = AgentSettings(node="n1", state_dir=tmp_path, pods_root=tmp_path / "pods",
                             kmsg_path=tmp_path / "no-kmsg", ib_root=tmp_path / "no-ib", nvml=False,
                             pod_labels=False)
    assert [s.name for s in build_agent(settings).sources] == ["container", "processes", "stack-survey"]
    off = settings.model_copy(update={"stack_survey_s": 0.0})
    assert [s.name for s in build_agent(off).sources] == ["container", "processes"]


def test_bad_rule_pack_stops_start_up_with_its_name(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "bad.yaml").write_text(
        "rules:\n  - id: broken\n    description: d\n    pattern: '(unclosed'\n    fault_class: node\n"
        "    severity: error\n    hardware: true\n    recommended_action: notify\n    examples: [x]\n"
        "    references: ['https://example.org']\n")
    settings = AgentSettings(node="n1", state_dir=tmp_path / "s", rules_dirs=[rules], nvml=False,
                             pod_labels=False)
    with pytest.raises(ConfigError, match=r"KMEND_AGENT_RULES_DIRS.*bad.yaml.*broken"):
        build_agent(settings)


def test_agent_logs_at_info_by_default_and_as_json_when_asked(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "kmend.cli", "--log-format", "json", "agent", "--node", "n1", "--service-url",
            "http://127.0.0.1:9", "--no-nvml", "--kernel", "off", "--pods-root", str(tmp_path / "pods"),
            "--state-dir", str(tmp_path / "state"), "--status-port", "0"]
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env={**os.environ, "KMEND_LOG_LEVEL": ""})
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
    finally:
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)
    rec = json.loads(line)
    assert rec["level"] == "INFO" and rec["logger"] == "kmend.agent" and "agent on n1" in rec["message"]
