"""Lines a terminal wrapped at its own width, pasted with no timestamp or prefix to tell the pieces apart,
are joined back (offline reader, `kmend analyze`, the corpus evaluation); real multi-line excerpts of the
corpus's development half whose longest lines share a length (tracebacks, tables, repeated records)
keep every record apart."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from collector.normalize import events_of
from kmend.cli import build_parser
from kmend.corpus_eval import load_corpus

CORPUS = Path(__file__).resolve().parent / "corpus"


@functools.cache
def _corpus() -> dict[str, Any]:
    return {e.id: e for e in load_corpus(CORPUS)}


def _dev(entry_id: str) -> str:
    entry = _corpus()[entry_id]
    assert entry.split == "dev", "only development excerpts may shape the reader"
    return entry.text


def _analyze(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> list[Any]:
    path = tmp_path / "container.log"
    path.write_text(text)
    args = build_parser().parse_args(["analyze", str(path), "--format", "json"])
    assert args.func(args) in (0, 3, 4)
    incidents: list[Any] = json.loads(capsys.readouterr().out)["incidents"]
    return incidents


def test_a_hook_error_the_terminal_wrapped_at_140_columns_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # https://github.com/NVIDIA/nvidia-docker/issues/543: one line of 697 characters, pasted as five pieces
    # of a 140-column terminal; "unsatisfied condi" / "tion: cuda >= 9.0" breaks the words the rule needs.
    text = _dev("nvidia-docker-543-requirement-wrapped-terminal")
    lines = text.splitlines()
    assert len(lines) == 5 and len({len(ln) for ln in lines[:4]}) == 1
    [event] = events_of(text)
    assert event == "".join(lines), "the pieces join with nothing between them: the terminal cut, not a space"
    [incident] = _analyze(tmp_path, capsys, text)
    [finding] = incident["findings"]
    assert finding["rule_id"] == "nvidia-container-requirement-unsatisfied"
    assert finding["fields"]["condition"] == "cuda >= 9.0"
    assert (incident["fault_class"], incident["recommended_action"]) == ("node", "notify")


def test_a_line_cut_at_the_width_of_a_long_exception_is_joined_with_its_url_whole() -> None:
    # https://github.com/huggingface/datasets/issues/6577: a 120-column terminal cut the URL and the file name
    text = _dev("datasets-6577-hfhub-500-streaming-wrapped")
    events = events_of(text)
    assert any("https://huggingface.co/datasets/sanchit-gandhi/" in e and "/train/train-02618-of-04012.parquet" in e
               for e in events)
    assert events[-1].startswith("Internal Error"), "the next record, upper-case after a full stop, stays apart"


# Development excerpts whose longest lines share one length and are followed by a line of their own:
# records repeated with their stamps, tables, tracebacks, health-check and benchmark output.
SAME_WIDTH_RECORDS = [
    "unet3d-25-tf-failed-to-allocate-from-device",  # TF records, same width, each starting with its stamp
    "grl-27-c10d-connect-any-address-bad-master",  # "trainer/0 [1]:[W ..." records
    "nccl-tests-322-mpirun-unhandled-cuda-error-at-scale",  # nccl-tests' " .. HCA-14 pid" second line
    "gpu-operator-193-driver-daemonset-crashloop-debian9",  # kubectl get pods table
    "nvidia-docker-399-smi-table-gtx1080",  # nvidia-smi table
    "kubeflow-68-healthy-gpu-training-speed",  # MXNet speed lines
    "nccl-629-init-complete-info",  # NCCL INFO lines of different hosts
    "datalad-4495-nfs-busy-at-exit",  # traceback frames
    "vina-cuda-3-cudaerrorillegaladdress-code-700",
    "azurehpc-hc-152-ib-write-bw-passed",
    "uccl-799-cqe-error-transport-retry-exceeded",
    "mlsh-17-mpi-bus-error-signal-7",  # MPI's "=====" banner
    "k8s-53207-kubelet-status-wedged-cri",  # kubectl describe node conditions
    "minikube-5690-kubelet-exec-restart-loop",
]


@pytest.mark.parametrize("entry_id", SAME_WIDTH_RECORDS)
def test_records_that_merely_share_the_longest_width_stay_apart(entry_id: str) -> None:
    text = _dev(entry_id)
    lines = text.splitlines()
    width = max(map(len, lines))
    assert width >= 80 and sum(len(ln) == width for ln in lines) >= 2, "the excerpt still tests the guard"
    events = events_of(text)
    for i, line in enumerate(lines[:-1]):
        nxt = lines[i + 1]
        if len(line) != width or not nxt.strip():
            continue
        glued = line[-12:] + nxt[:12]
        assert not any(glued in e for e in events), f"line {i + 1} was glued to the next: {glued!r}"
