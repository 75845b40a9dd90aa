"""The faulty GPU's `nvidia-smi -q` joins a plan's evidence: a GPU fault's plan asks the node's agent through the
node-request path it polls, the agent runs `nvidia-smi -q -i <GPU>` (here an executable on PATH printing a real
H100's `-q` report, tests/fixtures/gpu) and the whole report is kept in the evidence step's outputs; a node without
nvidia-smi answers so, and that is kept instead."""

from __future__ import annotations

import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from collector.gpu_query import GpuQueryHandler
from collector.node_requests import HttpNodeRequestClient, NodeRequest, NodeRequestRunner, RequestJournal
from tests.builders import kernel
from tests.test_runbook_api import OP, _serve

REPORT = Path(__file__).resolve().parent / "fixtures" / "gpu" / "h100-healthy-nvidia-smi-q.txt"
XID79 = "[ 8123.450001] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."


def _fake_smi(bin_dir: Path) -> Path:
    """nvidia-smi on PATH: records its arguments and prints the real report."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {bin_dir / 'calls'}\ncat {REPORT}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _evidence(s: Any, plan_id: str) -> dict[str, Any]:
    plan = s.client.get(f"/v1/plans/{plan_id}", headers=OP).json()
    return next(x for x in plan["steps"] if x["kind"] == "evidence")


def _run_agent(s: Any, tmp_path: Path, node: str, handler: GpuQueryHandler) -> tuple[NodeRequestRunner,
                                                                                      threading.Event]:
    client = HttpNodeRequestClient(str(s.client.base_url), token="agent-token")
    runner = NodeRequestRunner(node=node, client=client, interval=0.05, handlers={"gpu_query": handler},
                               journal=RequestJournal(tmp_path / "agent" / "requests.json"))
    stop = threading.Event()
    threading.Thread(target=runner.run, args=(stop,), daemon=True).start()
    return runner, stop


def test_the_faulty_gpus_nvidia_smi_q_is_kept_with_the_plans_evidence(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    _fake_smi(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    with _serve(tmp_path) as s:
        _, stop = _run_agent(s, tmp_path, "gpu-node-05", GpuQueryHandler())
        try:
            s.post_signals([kernel("gpu-node-05", XID79)])
            [plan] = s.wait(lambda: s.plans(node="gpu-node-05"))
            ev = s.wait(lambda: (e := _evidence(s, plan["id"]))["outputs"].get("nvidia_smi_q") and e, timeout=30)
        finally:
            stop.set()
    assert ev["outputs"]["nvidia_smi_q"] == REPORT.read_text().strip()  # whole: ~14,000 characters
    assert "Product Name                                       : NVIDIA H100 80GB HBM3" in ev["outputs"]["nvidia_smi_q"]
    assert ev["outputs"]["lines"], "the incident's own evidence lines are still there"
    assert (bin_dir / "calls").read_text().split("\n")[0] == "-q -i 00000000:3b:00.0"


def test_a_node_without_nvidia_smi_says_so_and_the_plan_goes_on(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with _serve(tmp_path) as s:
        _, stop = _run_agent(s, tmp_path, "gpu-node-06", GpuQueryHandler())
        try:
            s.post_signals([kernel("gpu-node-06", XID79)])
            [plan] = s.wait(lambda: s.plans(node="gpu-node-06"))
            ev = s.wait(lambda: (e := _evidence(s, plan["id"]))["outputs"].get("nvidia_smi_q_error") and e,
                        timeout=30)
        finally:
            stop.set()
        assert s.world.cluster.get_node("gpu-node-06").unschedulable
    assert "nvidia-smi not found on this node" in ev["outputs"]["nvidia_smi_q_error"]
    assert "nvidia_smi_q" not in ev["outputs"]


def test_the_handler_names_the_gpu_as_nvidia_smi_takes_it(tmp_path: Path) -> None:
    smi = _fake_smi(tmp_path)
    handler = GpuQueryHandler(nvidia_smi=str(smi))
    by_index = handler.run(NodeRequest("r1", "gpu_query", {"gpu": "3", "pci": "0000:3b:00"}), threading.Event())
    by_pci = handler.run(NodeRequest("r2", "gpu_query", {"gpu": "", "pci": "0000:3b:00"}), threading.Event())
    assert by_index.state == by_pci.state == "done"
    assert (tmp_path / "calls").read_text().split("\n")[:2] == ["-q -i 3", "-q -i 00000000:3b:00.0"]
    assert handler.run(NodeRequest("r3", "gpu_query", {}), threading.Event()).state == "failed"
