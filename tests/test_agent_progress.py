"""`kmend agent` ships training progress: hook files resume from checkpoints, step lines pass the prefilter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from analyzer.progress_rules import default_progress_rules_dir
from collector.agent import Agent
from collector.progress_hook import ProgressReporter
from kmend.commands.agent import AgentSettings, build_agent, build_prefilter
from tests.agent_helpers import CriWriter, spooled
from tests.conftest import free_port

MEGATRON = (" iteration      122/  250000 | consumed samples:       124928 | elapsed time per iteration (ms): 86545.2 |"
            " learning rate: 9.150E-06 | global batch size:  1024 | lm loss: 2.504220E+00 | loss scale: 1.0 |")
HF_TRAINER = "{'loss': 1.8123, 'grad_norm': 0.93, 'learning_rate': 4.9e-05, 'epoch': 0.12}"
NOISE = "tokenizer vocab size 32000, padded to 32768"


def _settings(tmp_path: Path, **kw: Any) -> AgentSettings:
    # A port nobody listens on: every batch lands in the spool, where the test reads it. Every step's sample is
    # shipped as read (summaries: tests/test_progress_summary.py).
    base: dict[str, Any] = {"progress_summary_s": 0,
                            "node": "gpu-3", "state_dir": tmp_path / "state", "pods_root": tmp_path / "pods",
                            "kernel": "off", "ib_root": tmp_path / "no-ib", "nvml": False, "pod_labels": False,
                            "service_url": f"http://127.0.0.1:{free_port()}"}
    return AgentSettings(**{**base, **kw})


def _pass(agent: Agent) -> None:
    agent.run_once()
    agent.flush()
    agent.flush()



def test_agent_ships_report_step_files_and_resumes_after_restart(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    rep = ProgressReporter(progress, "llama-70b", 3)
    rep.report_step(1, 0.5, {"compute": 0.4}, ts=1_700_000_000.0)
    rep.report_step(2, 0.5, ts=1_700_000_000.5)
    settings = _settings(tmp_path, progress_dir=progress)
    agent = build_agent(settings)
    assert "progress" in [s.name for s in agent.sources]
    _pass(agent)
    first = spooled(settings.state_dir)
    assert [(s["source"], s["payload"]["rank"], s["payload"]["step"]) for s in first] == [
        ("progress", 3, 1), ("progress", 3, 2)]

    # A restarted agent starts from the checkpoint: only the new step is shipped.
    rep.report_step(3, 0.5, ts=1_700_000_001.0)
    rep.close()
    _pass(build_agent(settings))
    again = spooled(settings.state_dir)
    assert [s["payload"]["step"] for s in again] == [3]
    assert {s["id"] for s in again}.isdisjoint({s["id"] for s in first})


def test_progress_dir_from_environment_and_absent_until_the_first_pod_writes(tmp_path: Path,
                                                                            monkeypatch: Any) -> None:
    monkeypatch.setenv("KMEND_AGENT_PROGRESS_DIR", str(tmp_path / "later"))
    settings = _settings(tmp_path)
    assert settings.progress_dir == tmp_path / "later"
    agent = build_agent(settings)
    agent.run_once()  # the directory does not exist yet: nothing, and no error
    assert spooled(settings.state_dir) == []
    ProgressReporter(tmp_path / "later", "j", 0).report_step(1, 0.1, ts=1_700_000_000.0)
    _pass(agent)
    assert [s["payload"]["step"] for s in spooled(settings.state_dir)] == [1]


def test_trainer_step_lines_survive_the_prefilter_and_noise_does_not(tmp_path: Path) -> None:
    w = CriWriter(tmp_path / "pods")
    for line in (NOISE, MEGATRON, HF_TRAINER,
                 " 12%|█▏        | 120/1000 [01:40<12:13,  1.20it/s]",
                 "[rank0]: step: 120  loss:  7.8921  memory: 61.43GiB(77.57%)  tps: 3,112  mfu: 38.21%",
                 NOISE):
        w.line(line)
    settings = _settings(tmp_path)
    _pass(build_agent(settings))
    texts = [s["payload"]["text"] for s in spooled(settings.state_dir)]
    assert NOISE not in texts
    assert MEGATRON in texts and HF_TRAINER in texts
    assert len(texts) == 4


def test_prefilter_extra_patterns_come_from_the_environment(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("KMEND_AGENT_PREFILTER_EXTRA", '["tokenizer vocab size"]')
    prefilter = build_prefilter(_settings(tmp_path))
    assert prefilter is not None and prefilter.matches(NOISE)


def test_every_progress_rule_example_passes_the_agent_prefilter(tmp_path: Path) -> None:
    prefilter = build_prefilter(_settings(tmp_path))
    assert prefilter is not None
    examples = [(rule["id"], ex["line"]) for pack in sorted(default_progress_rules_dir().glob("*.yaml"))
                for rule in yaml.safe_load(pack.read_text())["rules"] for ex in rule["examples"]]
    assert len(examples) > 10
    assert [(rid, line) for rid, line in examples if not prefilter.matches(line)] == []


def test_the_prefilter_keeps_crlf_lines_and_lines_with_a_vertical_tab(tmp_path: Path) -> None:
    # The scan reads raw bytes: a CRLF file keeps its "\r" before the newline (which a "$"-anchored rule must
    # allow), and hyperscan's \S leaves out the vertical tab that RE2's (the service's confirmation) takes in.
    prefilter = build_prefilter(_settings(tmp_path))
    assert prefilter is not None

    def lines_hit(buf: bytes) -> set[int]:
        return {buf[:end].count(b"\n") for end in prefilter.scan(buf)}

    assert lines_hit(b"noise\r\nNo devices were found\r\nmore\r\n") == {1}
    assert lines_hit(b"noise\nRuntimeError: File my\x0b_out/checkpoints/checkpoint_0.pt cannot be opened.\n") == {1}
