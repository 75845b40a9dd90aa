"""`kmend analyze` runs the hang detector on progress lines and folds Flight Recorder dumps into the incident."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kmend.cli import build_parser

UID = "6f1e2d3c-aaaa-bbbb-cccc-0123456789ab"
START = datetime(2026, 3, 2, 9, 0, 0, tzinfo=UTC)
FR = Path(__file__).parent / "fixtures" / "flight_recorder"
TITAN = ("[rank{r}]:[titan] {clock} - root - INFO - step: {step:2d}  loss:  {loss:.4f}  memory: 61.43GiB(77.57%)"
         "  tps: 3,112  tflops: 339.16  mfu: 34.29%")
WATCHDOG = ("[rank{r}]:[E302 09:{mm:02d}:{ss:02d}.715298746 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1048576, "
            "NumelOut=1048576, Timeout(ms)=600000) ran for 600011 milliseconds before timing out.")


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


def _pod_log(root: Path, node: str, pod: str, lines: list[tuple[datetime, str]]) -> None:
    d = root / node / "var" / "log" / "pods" / f"train_{pod}_{UID}" / "trainer"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "0.log", "a") as fh:
        for t, line in sorted(lines, key=lambda x: x[0]):
            fh.write(f"{_stamp(t)} stderr F {line}\n")


def _progress(ranks: range, steps: int, *, stop: dict[int, int] | None = None) -> list[tuple[datetime, str]]:
    """torchtitan step lines every 2 s per rank (torchrun's ``[rankN]:`` prefix); `stop`: rank -> last step."""
    out = []
    for step in range(1, steps + 1):
        t = START + timedelta(seconds=2 * step)
        clock = t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"
        for r in ranks:
            if step <= (stop or {}).get(r, steps):
                out.append((t + timedelta(milliseconds=r), TITAN.format(r=r, clock=clock, step=step,
                                                                        loss=8.0 - step * 0.01)))
    return out


def _analyze(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    args = build_parser().parse_args(["analyze", *argv, "--format", "json"])
    assert args.func(args) in (0, 3, 4)  # the codes say what was found (tests/test_analyze.py checks them)
    incidents: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["incidents"]
    return incidents


def test_a_rank_that_stopped_logging_is_the_root_of_the_hang(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "bundle"
    # Rank 3 never finishes step 41; the other seven do, then wait in the next all-reduce.
    lines = _progress(range(8), 41, stop={3: 40})
    _pod_log(bundle, "node-a", "llama-worker-0", [x for x in lines if x[1][5] in "0123"])
    _pod_log(bundle, "node-b", "llama-worker-1", [x for x in lines if x[1][5] in "4567"])
    # Ten minutes later NCCL's watchdog fires on the ranks that were waiting.
    t = START + timedelta(seconds=2 * 41 + 600)
    for node, pod, ranks in (("node-a", "llama-worker-0", (0, 1, 2)), ("node-b", "llama-worker-1", (4, 5, 6, 7))):
        _pod_log(bundle, node, pod, [(t, WATCHDOG.format(r=r, mm=t.minute, ss=t.second, seq=1322)) for r in ranks])
    incidents = _analyze(capsys, str(bundle))
    [inc] = incidents
    assert inc["root_cause"]["rank"] == 3 and inc["root_cause"]["node"] == "node-a"
    assert inc["root_cause"]["job"] == "llama"
    rules = {f["rule_id"] for f in inc["findings"]}
    assert "hang-detector" in rules and len(rules) >= 2  # the watchdog lines are folded in, not separate
    [hang] = [f for f in inc["findings"] if f["rule_id"] == "hang-detector"]
    assert hang["fault_class"] == "hang" and hang["rank"] == 3


def test_a_healthy_bundle_that_simply_ends_has_no_hang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "bundle"
    _pod_log(bundle, "node-a", "llama-worker-0", _progress(range(4), 60))
    assert _analyze(capsys, str(bundle)) == []


def test_a_rank_persistently_slower_than_its_peers_is_a_straggler(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "bundle"
    lines: list[tuple[datetime, str]] = []
    for step in range(1, 61):
        t = START + timedelta(seconds=step)
        for r in range(8):
            own = (0.65 if r == 5 else 0.50) + 0.002 * ((step * 7 + r * 3) % 5)  # rank 5 is 30% slower
            lines.append((t + timedelta(milliseconds=r), f"[rank{r}]: step {step} loss {3.0 - step * 0.01:.4f} "
                                                         f"step_time={own:.3f}"))
    _pod_log(bundle, "node-a", "bert-ft-worker-0", [x for x in lines if x[1][5] in "0123"])
    _pod_log(bundle, "node-b", "bert-ft-worker-1", [x for x in lines if x[1][5] in "4567"])
    [inc] = _analyze(capsys, str(bundle))
    assert inc["fault_class"] == "straggler"
    assert (inc["root_cause"]["rank"], inc["root_cause"]["node"], inc["root_cause"]["job"]) == (5, "node-b", "bert-ft")
    [f] = inc["findings"]
    assert 1.2 < float(f["fields"]["slowdown"]) < 1.4


def test_flight_recorder_dumps_in_the_bundle_name_the_rank_that_never_joined(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "bundle"
    _pod_log(bundle, "node-a", "gloo-job-worker-0", _progress(range(3), 20))
    # Ranks 0 and 2 dumped on the timeout; rank 1 (blocked before the collective) wrote none.
    for r, name in ((0, "comm_lib_trace_rank_0"), (2, "nccl_trace_rank_2")):  # current and older PyTorch names
        (bundle / "node-a" / f"gloo-job.{name}").write_bytes((FR / f"gloo_trace_rank_{r}").read_bytes())
    (bundle / "node-a" / "nccl_trace_rank_9").write_bytes(b"not a pickle")  # reported, not fatal
    incidents = _analyze(capsys, str(bundle))
    fr = [f for inc in incidents for f in inc["findings"] if f["rule_id"] == "flight-recorder"]
    assert [f["rank"] for f in fr] == [1] and fr[0]["job"] == "gloo-job"
    [inc] = [i for i in incidents if any(f["rule_id"] == "flight-recorder" for f in i["findings"])]
    assert inc["root_cause"]["rank"] == 1
