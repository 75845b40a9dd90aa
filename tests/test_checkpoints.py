"""Checkpoint discovery on layouts written by real torch (DCP, torch.save) and on partial or truncated ones."""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import pytest

from healer.checkpoints import CheckpointFormat, discover

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _state(step: int) -> dict[str, object]:
    return {"model": {"w": torch.full((32, 32), float(step)), "b": torch.zeros(32)}, "step": step}


def _dcp_save(path: Path, step: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save: no process group, on purpose
        dcp.save(_state(step), checkpoint_id=str(path))


def test_dcp_latest_complete_and_newer_partial_or_truncated_skipped(tmp_path: Path) -> None:
    for step in (100, 200, 300, 400):
        _dcp_save(tmp_path / f"step_{step}", step)
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.step == 400 and found.latest.format is CheckpointFormat.DCP
    (tmp_path / "step_400" / ".metadata").unlink()  # the save died before writing metadata
    shard = next((tmp_path / "step_300").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated shard
    (tmp_path / "step_200" / ".metadata").write_bytes(b"\x80\x04garbage")  # unreadable metadata
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.path == str(tmp_path / "step_100")
    why = dict(found.skipped)
    assert "missing" in why[str(tmp_path / "step_400")]
    assert "truncated" in why[str(tmp_path / "step_300")]
    assert "unreadable" in why[str(tmp_path / "step_200")]
    assert (tmp_path / "step_300").exists() and shard.exists()  # never deleted


def test_dcp_metadata_is_read_without_running_code_from_it(tmp_path: Path) -> None:
    _dcp_save(tmp_path / "step_1", 1)
    evil = tmp_path / "step_2"
    evil.mkdir()
    (evil / ".metadata").write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    found = discover(tmp_path)
    assert not (tmp_path / "pwned").exists()
    assert found.latest is not None and found.latest.step == 1


def test_deepspeed_needs_every_ranks_files(tmp_path: Path) -> None:
    for step, ranks in ((10, 4), (20, 4)):
        d = tmp_path / f"global_step{step}"
        d.mkdir()
        torch.save({"module": _state(step)}, d / "mp_rank_00_model_states.pt")
        for r in range(ranks):
            torch.save({"optimizer": r}, d / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step20")
    assert discover(tmp_path).latest.step == 20  # type: ignore[union-attr]
    os.remove(tmp_path / "global_step20" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.step == 10 and found.latest.format is CheckpointFormat.DEEPSPEED
    assert "rank(s) [2]" in dict(found.skipped)[str(tmp_path / "global_step20")]


def test_megatron_iteration_with_a_truncated_rank_file_is_skipped(tmp_path: Path) -> None:
    for it in (1000, 2000):
        for tp in range(2):
            d = tmp_path / f"iter_{it:07d}" / f"mp_rank_{tp:02d}"
            d.mkdir(parents=True)
            torch.save(_state(it), d / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2000")
    f = tmp_path / "iter_0002000" / "mp_rank_01" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.step == 1000 and found.latest.format is CheckpointFormat.MEGATRON
    assert "truncated" in dict(found.skipped)[str(tmp_path / "iter_0002000")]


def _safetensors(path: Path, n: int) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (4 * n))


def test_huggingface_checkpoint_needs_state_and_every_weight_shard(tmp_path: Path) -> None:
    for step in (500, 1000):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        for i in (1, 2):
            _safetensors(d / f"model-0000{i}-of-00002.safetensors", 64)
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    shard = tmp_path / "checkpoint-1000" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    found = discover(tmp_path)
    assert found.latest is not None and found.latest.step == 500 and found.latest.format is CheckpointFormat.HF
    assert "truncated" in dict(found.skipped)[str(tmp_path / "checkpoint-1000")]


def test_missing_path_reports_it(tmp_path: Path) -> None:
    found = discover(tmp_path / "nope")
    assert found.latest is None and "does not exist" in found.skipped[0][1]
