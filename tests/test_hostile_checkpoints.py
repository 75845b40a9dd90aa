"""Hostile checkpoint paths and files: bounded work, safe headers, only under the allowed roots."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

from analyzer.rules import Rule
from healer.checkpoints import CheckpointFormat, Limits, allowed, discover
from healer.executor import PlanExecutor
from healer.keys import RESUME_FROM
from healer.records import PlanState
from healer.workloads import ObjectKey
from tests.builders import XID79, container, kernel
from tests.healing import Harness, incident

REPO = Path(__file__).resolve().parent.parent


def _hf(ck: Path, step: int) -> Path:
    d = ck / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with zipfile.ZipFile(d / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", b"x")
    return d


class _StorageInfo:
    """Shaped like DCP's _StorageInfo: the unpickler sees its state, never runs it."""

    def __init__(self, relative_path: str, offset: int, length: int) -> None:
        self.relative_path, self.offset, self.length = relative_path, offset, length


def _reference_bomb(levels: int = 40) -> bytes:
    """DCP-shaped metadata whose every level refers twice to the next: 2**levels paths, `levels` objects."""
    node: list[object] = ["leaf"]
    for _ in range(levels):
        node = [node, node]
    return pickle.dumps({"state_dict_metadata": node, "storage_data": {}}, protocol=2)


def test_a_small_metadata_of_shared_references_is_walked_once_per_object(tmp_path: Path) -> None:
    _hf(tmp_path, 100)  # before: a good checkpoint
    bomb = tmp_path / "step_200"
    bomb.mkdir()
    data = _reference_bomb()
    assert len(data) < 400
    (bomb / ".metadata").write_bytes(data)
    # In a child process, so a walk of 2**40 nodes is stopped by the timeout rather than hanging the suite.
    code = ("import json, sys; from pathlib import Path; from healer.checkpoints import discover; "
            "d = discover(Path(sys.argv[1])); print(json.dumps([d.latest.path if d.latest else None, d.skipped]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=20, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    latest, skipped = json.loads(proc.stdout)
    assert latest == str(tmp_path / "checkpoint-100")
    assert [p for p, _ in skipped] == [str(bomb)] and "names no shards" in skipped[0][1]


def test_metadata_with_more_objects_than_the_budget_stops_the_search_and_says_so(tmp_path: Path) -> None:
    d = tmp_path / "step_5"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps({"items": [[i] for i in range(5000)]}))
    found = discover(tmp_path, limits=Limits(max_objects=1000))
    assert found.latest is None and "more than 1000 objects" in found.skipped[-1][1]


def test_a_search_over_its_time_budget_stops(tmp_path: Path) -> None:
    for step in range(20):
        _hf(tmp_path, step)
    ticks = iter(range(10_000))
    found = discover(tmp_path, limits=Limits(max_seconds=5), clock=lambda: float(next(ticks)))
    assert found.latest is None and "longer than 5 s" in found.skipped[-1][1]


def test_a_safetensors_header_length_of_2_to_the_62_is_a_skipped_checkpoint_not_a_memory_error(
        tmp_path: Path) -> None:
    _hf(tmp_path, 100)
    d = tmp_path / "checkpoint-200"
    d.mkdir()
    (d / "trainer_state.json").write_text('{"global_step": 200}')
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.path == str(tmp_path / "checkpoint-100")
    assert "header length 4611686018427387904 is impossible" in dict(found.skipped)[str(d)]


def test_malformed_headers_and_json_are_skipped_with_the_reason(tmp_path: Path) -> None:
    _hf(tmp_path, 100)
    d = tmp_path / "checkpoint-200"
    d.mkdir()
    (d / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)  # deeper than the JSON parser goes
    e = tmp_path / "checkpoint-300"
    e.mkdir()
    (e / "trainer_state.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "data_offsets": "everything"}}).encode()
    (e / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.step == 100
    why = dict(found.skipped)
    assert "trainer_state.json unreadable" in why[str(d)]
    assert "no valid data_offsets" in why[str(e)]


def test_only_paths_under_the_allowed_roots_are_searched(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _hf(root / "job-a", 10)
    roots = [root]
    assert discover(root / "job-a", roots=roots).latest is not None
    for hostile in (Path("/etc"), Path("/proc/self"), root / ".." / "elsewhere", Path("/")):
        found = discover(hostile, roots=roots)
        assert found.latest is None and "outside the allowed roots" in found.skipped[0][1], hostile
    (root / "escape").symlink_to("/etc")
    assert "really /etc" in discover(root / "escape", roots=roots).skipped[0][1]
    assert "KMEND_CHECKPOINT_ROOTS" in (allowed(root, []) or "")


def test_symlinks_and_dot_dot_out_of_the_checkpoint_root_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _hf(outside, 900)
    secret = outside / "secret.bin"
    secret.write_bytes(b"x" * 10_000)
    root = tmp_path / "ck"
    _hf(root, 100)
    (root / "checkpoint-999").symlink_to(outside / "checkpoint-900")  # a newer "checkpoint" that is not ours
    dcp = root / "step_500"
    dcp.mkdir()
    # DCP metadata naming a shard through '..': its size would otherwise say "complete".
    (dcp / ".metadata").write_bytes(pickle.dumps({"storage": [_StorageInfo("../../outside/secret.bin", 0, 10)]}))
    found = discover(root, roots=[tmp_path])
    assert found.latest is not None and found.latest.path == str(root / "checkpoint-100")
    assert str(root / "checkpoint-999") not in dict(found.skipped)  # never even a candidate
    assert "leads outside the checkpoint root" in dict(found.skipped)[str(dcp)]
    assert found.latest.format is CheckpointFormat.HF


def test_the_healer_refuses_a_checkpoint_annotation_outside_the_allowed_roots(
        tmp_path: Path, shipped_rules: list[Rule]) -> None:
    rules = shipped_rules
    allowed_root = tmp_path / "allowed"
    _hf(allowed_root / "llama", 50)
    good = str(allowed_root / "llama")
    for path, resumed in (("/etc", None), (good, f"{good}/checkpoint-50")):
        (tmp_path / f"h{resumed is None}").mkdir()
        h = Harness(tmp_path / f"h{resumed is None}", nodes=16, spares=2, job_nodes=4, checkpoint_path=path)
        h.ctx = replace(h.ctx, checkpoint_roots=(str(allowed_root),))
        h.executor = PlanExecutor(h.ctx, h.store, guard=h.guard, sleep=h.sleeps.append)
        bad = "gpu-node-02"
        plan = h.run(h.plan(incident(rules, [container(bad, "iteration 1", job="llama"), kernel(bad, XID79)])))
        assert plan.state is PlanState.RUNNING
        [ck] = [s for s in plan.steps if s.kind.value == "checkpoint"]
        annotations = h.workloads.get_object(_owner())["metadata"].get("annotations", {})
        if resumed is None:
            # The control plane never walks a path outside its roots: it is searched, bounded and without
            # following links, only inside the job's own pod by a node agent (none runs here), or refused.
            assert ("outside the allowed roots" in ck.result or "searches /etc in pod" in ck.result) \
                and RESUME_FROM not in annotations, ck.result
        else:
            assert annotations[RESUME_FROM] == resumed


def _owner() -> ObjectKey:
    return ObjectKey("kubeflow.org/v1", "PyTorchJob", "training", "llama")


def test_allowed_roots_resolve_symlinks_of_the_roots_themselves(tmp_path: Path) -> None:
    real = tmp_path / "real"
    _hf(real / "job", 1)
    os.symlink(real, tmp_path / "alias")
    assert allowed(tmp_path / "alias" / "job", [real]) is None
