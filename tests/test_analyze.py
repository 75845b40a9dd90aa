"""`kmend analyze`: a bundle with an Xid 79 and NCCL timeouts on every rank is one incident rooted
at the Xid node; benign bundles print none; pods trees, CRI prefixes, kubectl dumps and stdin are read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from collector.bundle import BundleSource, LogKind, job_from_pod
from collector.timestamps import parse_timestamp
from kmend.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
BENIGN = Path(__file__).parent / "data" / "benign.log"
XID79 = "[ 5000.100000] NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus."
TIMEOUT = ("[rank{r}]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught "
           "collective operation timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=544997376, "
           "NumelOut=68124672, Timeout(ms)=600000) ran for 600061 milliseconds before timing out.")
UID = "0d3c2b1a-aaaa-bbbb-cccc-123456789abc"


def cri(ts: str, line: str, stream: str = "stderr", tag: str = "F") -> str:
    return f"{ts} {stream} {tag} {line}\n"


def write_bundle(root: Path) -> Path:
    """Two nodes, one pod of job 'llama' on each with four ranks; node-a's GPU falls off the bus."""
    benign = BENIGN.read_text().splitlines()
    (root / "node-a").mkdir(parents=True)
    (root / "node-a" / "dmesg.log").write_text(
        "[   10.123456] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.195.03  Release Build\n"
        + XID79 + "\n[ 5000.200000] NVRM: GPU 0000:44:00.0: GPU has fallen off the bus.\n")
    placement = (("node-a", "llama-worker-0", range(4)), ("node-b", "llama-worker-1", range(4, 8)))
    for node, pod, ranks in placement:
        d = root / node / "var" / "log" / "pods" / f"train_{pod}_{UID}" / "trainer"
        d.mkdir(parents=True)
        text = "".join(cri("2024-12-06T18:34:12.100000000Z", b, "stdout") for b in benign[:8])
        text += "".join(cri("2024-12-06T18:44:12.715298746Z", TIMEOUT.format(r=r)) for r in ranks)
        (d / "0.log").write_text(text)
    return root


def analyze_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["analyze", *argv, "--format", "json"])
    assert args.func(args) in (0, 3, 4)  # the codes say what was found (tests/test_analyze.py checks them)
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_xid79_and_timeouts_on_eight_ranks_are_one_incident_rooted_at_the_xid_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = analyze_json(capsys, str(write_bundle(tmp_path / "bundle")))
    [inc] = out["incidents"]  # type: ignore[misc]
    assert set(inc) == {"fault_class", "hardware", "recommended_action", "root_cause", "findings"}
    assert (inc["fault_class"], inc["hardware"]) == ("gpu_lost", True)
    assert inc["recommended_action"] == "replace_node"
    assert inc["root_cause"] == {
        "node": "node-a", "gpu": None, "pci": "0000:44:00", "rank": None, "job": "llama",
        "namespace": "train"}
    rules = [f["rule_id"] for f in inc["findings"]]
    assert rules[0] == "xid-79" and rules.count("nccl-watchdog-timeout") == 8
    # The driver's own "GPU has fallen off the bus" line after the Xid is the same GPU, the same incident.
    assert rules.count("nvrm-gpu-fallen-off-bus") == 1
    timeouts = [f for f in inc["findings"] if f["rule_id"] == "nccl-watchdog-timeout"]
    assert sorted(f["rank"] for f in timeouts) == list(range(8))
    assert {f["fields"]["seq"] for f in timeouts} == {"7753"}


def test_benign_only_bundle_prints_no_incident(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train.log").write_text(BENIGN.read_text())
    assert analyze_json(capsys, str(tmp_path / "b")) == {"incidents": []}


def test_the_cli_reads_stdin_and_prints_a_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kmend.cli", "analyze", "-", "--node", "gpu-17"],
        input=XID79 + "\n", capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 3, proc.stderr  # a hardware fault: a pre-flight or CI gate fails on it
    assert "gpu_lost" in proc.stdout and "gpu-17" in proc.stdout and "replace_node" in proc.stdout


def test_pods_tree_and_cri_prefixes_are_understood(tmp_path: Path) -> None:
    d = tmp_path / "n7" / "var" / "log" / "pods" / f"ml_gpt-worker-12_{UID}" / "main"
    d.mkdir(parents=True)
    (d / "0.log").write_text(
        cri("2024-05-11T14:10:52.224071234Z", "RuntimeError: CUDA error: ", tag="P")
        + cri("2024-05-11T14:10:52.224071234Z", "an illegal memory access was encountered"))
    src = BundleSource([str(tmp_path)])
    [f] = src.files()
    assert (f.node, f.namespace, f.pod, f.container, f.job, f.kind) == (
        "n7", "ml", "gpt-worker-12", "main", "gpt", LogKind.CONTAINER)
    fl = src.lines(f)
    assert fl.texts == ["RuntimeError: CUDA error: an illegal memory access was encountered"]
    sig = src.signal(fl, 0)
    assert sig.source == "container" and sig.node == "n7"
    assert sig.ts == pytest.approx(1715436652.224, abs=1e-3)


def test_kubectl_prefix_dump_names_pods_and_jobs(tmp_path: Path) -> None:
    p = tmp_path / "dump.txt"
    p.write_text("[pod/llama-worker-3/trainer] RuntimeError: CUDA error: device-side assert triggered\n")
    src = BundleSource([str(p)], node="n1")
    fl = src.lines(src.files()[0])
    line = src.signal(fl, 0).payload
    assert getattr(line, "pod", None) == "llama-worker-3" and getattr(line, "job", None) == "llama"


@pytest.mark.parametrize(("line", "kind"), [
    ("[  123.456789] NVRM: Xid", "boot"),
    ("2024-05-11T14:10:52.224Z stderr F x", "epoch"),
    ("Sep 19 10:30:06 host kernel: NVRM: Xid", "epoch"),
    ("[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] x", "epoch"),
    ("[Fri Aug 30 11:43:09 2024] NVRM: Xid", "epoch"),
])
def test_timestamps_of_the_usual_formats_parse(line: str, kind: str) -> None:
    parsed = parse_timestamp(line)
    assert parsed is not None and parsed[1] == kind


def test_jobs_come_from_pod_names() -> None:
    assert job_from_pod("llama-pretrain-worker-3") == "llama-pretrain"
    assert job_from_pod("bert-7") == "bert"
    assert job_from_pod("standalone") == "standalone"


def test_a_bundle_without_job_or_node_labels_still_folds_timeouts_under_the_xid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """dmesg of the failed node plus a bare training log (no pod path): one job is assumed."""
    (tmp_path / "dmesg.txt").write_text(XID79 + "\n")
    (tmp_path / "train.log").write_text("\n".join(TIMEOUT.format(r=r) for r in range(4)) + "\n")
    out = analyze_json(capsys, str(tmp_path / "dmesg.txt"), str(tmp_path / "train.log"))
    [inc] = out["incidents"]  # type: ignore[misc]
    assert inc["fault_class"] == "gpu_lost" and inc["root_cause"]["pci"] == "0000:44:00"
    assert [f["rule_id"] for f in inc["findings"]].count("nccl-watchdog-timeout") == 4


def test_json_piped_into_a_reader_that_leaves_early_is_not_an_error(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    kmend = str(Path(sys.executable).parent / "kmend")
    out = subprocess.run(f"'{kmend}' analyze '{bundle}' --format json | head -1", shell=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == "{\n" and "Traceback" not in out.stderr


def test_exit_codes_gate_on_what_was_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "clean.log").write_text("[ 1.0] Linux version 6.8.0 (buildd@lcy02)\n")
    (tmp_path / "hw.log").write_text(XID79 + "\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "train.log").write_text(
        "RuntimeError: CUDA error: an illegal memory access was encountered\n")
    for path, want in ((tmp_path / "clean.log", 0), (tmp_path / "hw.log", 3), (tmp_path / "app", 4)):
        args = build_parser().parse_args(["analyze", str(path), "--node", "gpu-3"])
        assert args.func(args) == want, (path, capsys.readouterr().out)
    args = build_parser().parse_args(["analyze", str(tmp_path / "hw.log"), "--exit-zero"])
    assert args.func(args) == 0
