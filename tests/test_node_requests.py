"""Node requests carried out by the node agent: GPU reset (idle wait, nvidia-smi, health read back, exactly
once across agent restarts), checkpoint searches inside a pod's own filesystem, and plans that say at once
when no agent can do the work instead of timing out after half an hour."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import yaml

from analyzer.rules import default_rules_dir, load_rules
from collector.container_fs import FindCheckpointHandler, container_path
from collector.gpu_reset import GpuResetHandler, pci_key
from collector.node_requests import HttpNodeRequestClient, NodeRequest, NodeRequestRunner, RequestJournal
from collector.sources.nvml_fake import FakeGpu, FakeNvml
from healer.checkpoint_remote import discover_json
from healer.policy_file import default_policy_path
from healer.workloads import ObjectKey
from tests.builders import container, kernel
from tests.healing import Harness, incident
from tests.test_runbook_api import AGENT, OP, _serve

XID48 = ("[ 100.0] NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit "
         "error (DBE) has been detected on GPU in the framebuffer at partition 5, subpartition 1")


def _fake_smi(tmp: Path, code: int = 0, out: str = "GPU 00000000:18:00.0 was successfully reset.") -> Path:
    """An executable standing in for nvidia-smi: records its arguments, prints, exits with `code`."""
    script = tmp / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp / 'smi-calls'}\necho '{out}'\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _calls(tmp: Path) -> list[str]:
    f = tmp / "smi-calls"
    return f.read_text().splitlines() if f.exists() else []


def _gpus() -> list[FakeGpu]:
    return [FakeGpu("GPU-aaaa", "00000000:07:00.0"), FakeGpu("GPU-bbbb", "00000000:18:00.0")]


def test_pci_ids_match_across_nvml_xid_and_nvidia_smi_spellings() -> None:
    assert pci_key("00000000:18:00.0") == pci_key("0000:18:00") == pci_key("18:00.0") == (0, 0x18, 0)
    assert pci_key("0000:3B:00") == pci_key("00000000:3b:00.0") != pci_key("0001:3b:00")
    assert pci_key("gpu 3") is None


def test_reset_waits_for_the_gpu_to_go_idle_then_resets_and_reads_health_back(tmp_path: Path) -> None:
    gpus = _gpus()
    gpus[1].processes = [4242]
    gpus[1].remapped_rows = (0, 1, 1, 0)  # a row waits for the reset to be remapped
    nv = FakeNvml(gpus)
    smi = _fake_smi(tmp_path)

    def clear_after_reset(argv: list[str], timeout: float) -> tuple[int, str]:
        from collector.gpu_reset import run_command
        code, out = run_command(argv, timeout)
        gpus[1].remapped_rows = (0, 1, 0, 0)  # the reset remapped the row
        return code, out

    h = GpuResetHandler(load_nvml=lambda: nv, nvidia_smi=str(smi), run=clear_after_reset, idle_poll_s=0.02)
    req = NodeRequest("plan-1-5", "reset_gpu", {"gpu": "1", "pci": "0000:18:00"})
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(h.run(req, threading.Event())))
    t.start()
    time.sleep(0.3)
    assert _calls(tmp_path) == [] and t.is_alive()  # pid 4242 still holds the GPU: no reset yet
    gpus[1].processes = []
    t.join(5)
    [ans] = result
    assert ans.state == "done", ans  # type: ignore[attr-defined]
    assert _calls(tmp_path) == ["--gpu-reset -i 00000000:18:00.0"]  # by PCI id: the GPU the Xid named
    assert "healthy" in ans.message  # type: ignore[attr-defined]


def test_reset_gives_up_on_a_gpu_that_stays_busy_and_never_resets_it(tmp_path: Path) -> None:
    gpus = _gpus()
    gpus[1].processes = [7, 8]
    h = GpuResetHandler(load_nvml=lambda: FakeNvml(gpus), nvidia_smi=str(_fake_smi(tmp_path)),
                        idle_timeout_s=0.2, idle_poll_s=0.02)
    ans = h.run(NodeRequest("r", "reset_gpu", {"pci": "0000:18:00"}), threading.Event())
    assert ans.state == "failed" and "[7, 8]" in ans.message and _calls(tmp_path) == []


def test_reset_reports_nvidia_smi_failure_and_a_row_remap_failure(tmp_path: Path) -> None:
    h = GpuResetHandler(load_nvml=lambda: FakeNvml(_gpus()),
                        nvidia_smi=str(_fake_smi(tmp_path, 3, "Unable to reset this GPU because it is being used")))
    ans = h.run(NodeRequest("r", "reset_gpu", {"pci": "0000:18:00"}), threading.Event())
    assert ans.state == "failed" and "exited 3" in ans.message and "being used" in ans.message
    gpus = _gpus()
    gpus[1].remapped_rows = (0, 9, 0, 1)
    h = GpuResetHandler(load_nvml=lambda: FakeNvml(gpus), nvidia_smi=str(_fake_smi(tmp_path)))
    ans = h.run(NodeRequest("r", "reset_gpu", {"pci": "0000:18:00"}), threading.Event())
    assert ans.state == "failed" and "row remapping failed" in ans.message
    ans = h.run(NodeRequest("r", "reset_gpu", {"pci": "0000:99:00"}), threading.Event())
    assert ans.state == "failed" and "fallen off the bus" in ans.message


class _Service:
    """The service's two request endpoints, in memory."""

    def __init__(self, requests: list[NodeRequest]) -> None:
        self.requests = requests
        self.answers: dict[str, tuple[str, str]] = {}
        self.capabilities: list[str] = []
        self.up = True

    def pending(self, node: str, capabilities: list[str]) -> list[NodeRequest]:
        if not self.up:
            raise httpx.ConnectError("service away")
        self.capabilities = capabilities
        return [r for r in self.requests if r.id not in self.answers]

    def answer(self, node: str, request_id: str, answer: object) -> bool:
        if not self.up:
            raise httpx.ConnectError("service away")
        self.answers[request_id] = (answer.state, answer.message)  # type: ignore[attr-defined]
        return True


def test_agent_restart_mid_reset_reads_the_outcome_back_and_never_resets_twice(tmp_path: Path) -> None:
    nv = FakeNvml(_gpus())
    h = GpuResetHandler(load_nvml=lambda: nv, nvidia_smi=str(_fake_smi(tmp_path)))
    svc = _Service([NodeRequest("plan-9-4", "reset_gpu", {"pci": "0000:18:00"})])
    journal = RequestJournal(tmp_path / "requests.json")
    journal.started("plan-9-4")  # the agent died after journaling, around the nvidia-smi call
    runner = NodeRequestRunner(node="n1", client=svc, journal=RequestJournal(tmp_path / "requests.json"),
                               handlers={"reset_gpu": h})
    runner.poll_once(threading.Event())
    assert runner.wait_idle(5)
    assert _calls(tmp_path) == []  # not reset again
    assert svc.answers["plan-9-4"][0] == "done" and "not reset again" in svc.answers["plan-9-4"][1]
    runner.poll_once(threading.Event())
    assert runner.wait_idle(5) and _calls(tmp_path) == []


def test_an_answer_the_service_missed_is_sent_again_and_the_request_not_rerun(tmp_path: Path) -> None:
    h = GpuResetHandler(load_nvml=lambda: FakeNvml(_gpus()), nvidia_smi=str(_fake_smi(tmp_path)))
    svc = _Service([NodeRequest("r1", "reset_gpu", {"pci": "0000:18:00"})])
    runner = NodeRequestRunner(node="n1", client=svc, journal=RequestJournal(tmp_path / "j.json"),
                               handlers={"reset_gpu": h})
    real_answer = svc.answer
    svc.answer = lambda *a: (_ for _ in ()).throw(httpx.ConnectError("away"))  # type: ignore[method-assign]
    runner.poll_once(threading.Event())
    assert runner.wait_idle(5) and svc.answers == {} and len(_calls(tmp_path)) == 1
    svc.answer = real_answer  # type: ignore[method-assign]
    restarted = NodeRequestRunner(node="n1", client=svc, journal=RequestJournal(tmp_path / "j.json"),
                                  handlers={"reset_gpu": h})
    restarted.poll_once(threading.Event())
    assert restarted.wait_idle(5)
    assert svc.answers["r1"][0] == "done" and len(_calls(tmp_path)) == 1
    assert svc.capabilities == ["reset_gpu"]


def test_reset_gpu_plan_is_carried_out_by_the_agent_through_the_service(tmp_path: Path) -> None:
    gpus = _gpus()
    nv = FakeNvml(gpus)
    smi = _fake_smi(tmp_path)
    with _serve(tmp_path) as s:
        client = HttpNodeRequestClient(str(s.client.base_url), token="agent-token")
        runner = NodeRequestRunner(node="gpu-node-09", client=client, interval=0.05,
                                   journal=RequestJournal(tmp_path / "agent" / "requests.json"),
                                   handlers={"reset_gpu": GpuResetHandler(load_nvml=lambda: nv,
                                                                          nvidia_smi=str(smi))})
        stop = threading.Event()
        threading.Thread(target=runner.run, args=(stop,), daemon=True).start()
        try:
            s.post_signals([kernel("gpu-node-09", XID48)])
            [plan] = s.wait(lambda: s.plans(node="gpu-node-09"))
            final = s.wait(lambda: (p := s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json())["state"]
                           in ("succeeded", "failed") and p, timeout=20)
        finally:
            stop.set()
    assert final["state"] == "succeeded", [(x["kind"], x["state"], x["result"]) for x in final["steps"]]
    assert _calls(tmp_path) == ["--gpu-reset -i 00000000:18:00.0"]
    repair = next(x for x in final["steps"] if x["kind"] == "repair")
    assert "reset and healthy" in repair["result"]


def test_a_reset_waiting_for_its_gpu_to_go_idle_stops_when_the_plan_is_rejected(tmp_path: Path) -> None:
    """The agent has started the reset and waits for the job to leave the GPU; the operator rejects the plan (the job
    keeps the GPU): the agent's next poll no longer sees the request, so the wait ends and the GPU is never reset."""
    gpus = _gpus()
    gpus[1].processes = [4242]  # the training job still holds the GPU
    nv = FakeNvml(gpus)
    with _serve(tmp_path) as s:
        client = HttpNodeRequestClient(str(s.client.base_url), token="agent-token")
        answers: list[str] = []
        runner = NodeRequestRunner(node="gpu-node-09", client=client, interval=0.05,
                                   journal=RequestJournal(tmp_path / "agent" / "requests.json"),
                                   handlers={"reset_gpu": GpuResetHandler(load_nvml=lambda: nv,
                                                                          nvidia_smi=str(_fake_smi(tmp_path)),
                                                                          idle_poll_s=0.05)},
                                   on_answer=lambda req, ans: answers.append(f"{req.kind} {ans.state}: {ans.message}"))
        stop = threading.Event()
        threading.Thread(target=runner.run, args=(stop,), daemon=True).start()
        try:
            s.post_signals([kernel("gpu-node-09", XID48)])
            [plan] = s.wait(lambda: s.plans(node="gpu-node-09"))
            [reset] = s.wait(lambda: [q for q in s.client.get("/v1/nodes/gpu-node-09/requests", headers=AGENT)
                                      .json()["requests"] if q["kind"] == "reset_gpu"], timeout=20)
            s.wait(lambda: (runner.journal.get(reset["id"]) or {}).get("state") == "started", timeout=20)
            r = s.client.post(f"/v1/plans/{plan['id']}/reject", headers=OP)
            assert r.status_code == 200 and r.json()["state"] == "rejected", r.text
            s.wait(lambda: [a for a in answers if a.startswith("reset_gpu")], timeout=20)
            gpus[1].processes = []  # the job ends later: the agent must not reset the GPU then
            time.sleep(0.5)
        finally:
            stop.set()
        assert runner.wait_idle(10)
    [answer] = [a for a in answers if a.startswith("reset_gpu")]
    assert answer.startswith("reset_gpu failed") and "withdrew" in answer and "not reset" in answer, answer
    assert _calls(tmp_path) == []


def test_a_reset_with_no_agent_on_the_node_fails_within_a_minute_with_the_reason(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    inc = incident(load_rules([default_rules_dir()]), [kernel("gpu-node-02", XID48, ts=h.clock())])
    plan = h.run(h.plan(inc), rounds=120)
    assert plan.state.value == "failed", [(s.kind.value, s.state.value, s.result) for s in plan.steps]
    repair = next(s for s in plan.steps if s.kind.value == "repair")
    assert "no kmend agent on gpu-node-02" in repair.result
    # Withdrawn: an agent that turns up later finds nothing to do.
    assert h.store.ledger.requests_for("gpu-node-02") == []


def _pod_tree(proc: Path, pid: int, uid: str) -> Path:
    """/proc/<pid> of a container process of pod `uid` (systemd cgroup driver spelling)."""
    d = proc / str(pid)
    (d / "root").mkdir(parents=True)
    slice_uid = uid.replace("-", "_")
    (d / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice_uid}"
                              ".slice/cri-containerd-0123abcd.scope\n")
    return d / "root"


def _hf_checkpoint(d: Path, *, complete: bool) -> None:
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    body = len(header).to_bytes(8, "little") + header + (b"\0" * 8 if complete else b"\0" * 3)
    (d / "model.safetensors").write_bytes(body)


def test_checkpoint_search_reads_the_pods_own_mounts_and_refuses_links_out(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "cgroup").write_text("0::/init.scope\n")
    root = _pod_tree(proc, 4711, "6f1e-22aa-4bd0")
    _hf_checkpoint(root / "ckpt" / "checkpoint-10", complete=True)
    _hf_checkpoint(root / "ckpt" / "checkpoint-20", complete=False)
    h = FindCheckpointHandler(proc_root=proc, discover=discover_json)
    ans = h.run(NodeRequest("r", "find_checkpoint", {"pod_uid": "6f1e-22aa-4bd0", "path": "/ckpt"}),
                threading.Event())
    assert ans.state == "done"
    got = json.loads(ans.message)
    assert got["latest"] == {"path": "/ckpt/checkpoint-10", "step": 10, "format": "huggingface"}
    assert got["skipped"][0][0] == "/ckpt/checkpoint-20" and "truncated" in got["skipped"][0][1]
    outside = tmp_path / "host-etc"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    assert "symbolic link" in str(container_path(proc, "6f1e-22aa-4bd0", "/escape"))
    assert container_path(proc, "6f1e-22aa-4bd0", "/ckpt/../../../ckpt") == root / "ckpt"  # never above the pod's /
    assert "no process of pod" in str(container_path(proc, "0000-1111", "/ckpt"))


def test_replace_plan_resumes_from_a_checkpoint_only_a_node_agent_can_see(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    policy = yaml.safe_load(default_policy_path().read_text())
    policy["defaults"]["drain_grace_s"] = 0  # simulated pods end at once
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    # The control plane mounts no job volume.
    with _serve(tmp_path, checkpoint_roots=[], policy_file=tmp_path / "policy.yaml") as s:
        pods = s.world.workloads.list_pods(namespace="training")
        for p in pods:
            s.world.workloads.annotate(ObjectKey("v1", "Pod", p.namespace, p.name),
                                       {"kmend.io/checkpoint-path": "/mnt/ckpt"})
            root = _pod_tree(proc, 1000 + pods.index(p), p.uid)
            _hf_checkpoint(root / "mnt" / "ckpt" / "checkpoint-30", complete=True)
        failed_node = pods[0].node
        client = HttpNodeRequestClient(str(s.client.base_url), token="agent-token")
        stop = threading.Event()
        for node in {p.node for p in pods}:
            r = NodeRequestRunner(node=node, client=client, interval=0.05,
                                  journal=RequestJournal(tmp_path / node / "requests.json"),
                                  handlers={"find_checkpoint": FindCheckpointHandler(proc_root=proc,
                                                                                     discover=discover_json)})
            threading.Thread(target=r.run, args=(stop,), daemon=True).start()
        try:
            s.post_signals([container(failed_node, "step 1", job="llama", rank=0),
                            kernel(failed_node, "[ 8123.450001] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, "
                                                "GPU has fallen off the bus.")])
            [plan] = s.wait(lambda: s.plans(node=failed_node))
            step = s.wait(lambda: next((x for x in s.client.get(f"/v1/plans/{plan['id']}", headers=OP)
                                        .json()["steps"] if x["kind"] == "checkpoint"
                                        and x["state"] in ("succeeded", "skipped", "failed")), None), timeout=20)
        except AssertionError:
            raise AssertionError(s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json()) from None
        finally:
            stop.set()
    assert step["state"] == "succeeded", step
    assert "checkpoint-30" in step["result"] and step["outputs"]["resume_from"] == "/mnt/ckpt/checkpoint-30"
