"""Rule-engine throughput: the full shipped pack over a realistic log mix.

    python bench/rules.py                 # 200 MB mix, prints one JSON object per result
    python bench/rules.py --mb 20 --naive-mb 2

The line with ``"summary"`` gives the file path and the service path as ratios to raw hyperscan over the
same bytes, measured in the same run. The service path is ingest's own call into the engine,
``FastMatcher.match(signals)`` (what ``Analyzer.process`` calls for every ``POST /v1/signals`` batch), on the
mix shipped as the agent ships it (1,000 log signals a body, the agent's encoder) and decoded by the
service's decoder before each batch (untimed).

The mix is training stdout, NCCL INFO chatter and kernel noise with about 0.1% real
fault lines (taken from the rules' own examples). Results: MB/s and lines/s per core for
the multi-pattern engine (a log file's bytes -> findings, and a list of lines -> findings)
and for the naive loop that runs every
rule's regex on every line. The naive loop is slow, so it runs on the first
``--naive-mb`` of the same data and its rate is reported as measured on that subset.

The floor is raw hyperscan: the engine's own database over the same bytes in the same run,
reporting hits only. ``ratio_to_raw`` is raw's time over the engine's (1.0 would be free line
mapping, confirmation and findings), in CPU seconds of this process, best round of each.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.engine import Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.matcher import FastMatcher, finding_from_match
from analyzer.rules import Rule, default_rules_dir, load_rules
from collector.shipper import encode_batch
from collector.signal import LogLine, Signal, Source
from kmend.api.signal_decode import decode_fast

# Shapes of the everyday lines of a training pod and a GPU node (formats as the tools print them).
TRAIN = ("[rank{r}]: step {s}/200000 | loss {l:.4f} | lr {lr:.3e} | grad_norm {g:.3f}"
         " | tokens/s {t} | mem 61.2GiB")
NCCL_INFO = [
    "{h}:{p}:{p} [{d}] NCCL INFO Channel {c:02d}/32 : {d} -> {e} [send] via NET/IB/{d}/GDRDMA",
    "{h}:{p}:{p} [{d}] NCCL INFO Connected all rings",
    "{h}:{p}:{p} [{d}] NCCL INFO comm 0x55d1c2a3b4c0 rank {r} nranks 1024 cudaDev {d} busId {d}b000"
    " - Init COMPLETE",
    "{h}:{p}:{p} [{d}] NCCL INFO 16 coll channels, 0 collnet channels, 16 nvls channels, 16 p2p channels,"
    " 2 p2p channels per peer",
    "{h}:{p}:{p} [{d}] NCCL INFO NET/Plugin: Could not find: libnccl-net.so",
]
KERNEL = [
    "[{ts:.6f}] IPv6: ADDRCONF(NETDEV_CHANGE): cali{c}a1b2: link becomes ready",
    "[{ts:.6f}] audit: type=1400 audit({ts:.3f}:{p}): apparmor=\"DENIED\" operation=\"open\""
    " profile=\"cri-containerd\"",
    "[{ts:.6f}] nvidia-nvswitch{d}: using MSI",
    "[{ts:.6f}] mlx5_core 0000:{d}b:00.0: Port module event: module {d}, Cable plugged",
    "[{ts:.6f}] EXT4-fs (nvme0n1p{d}): mounted filesystem with ordered data mode. Quota mode: none.",
]


def generate(rules: Sequence[Rule], target_bytes: int, seed: int = 7) -> tuple[list[str], int]:
    """The log mix as lines; returns the lines and how many of them are fault lines."""
    rng = random.Random(seed)
    faults = [ex for r in rules for ex in r.examples]
    lines: list[str] = []
    size = 0
    n_faults = 0
    while size < target_bytes:
        x = rng.random()
        if x < 0.001:
            ln = rng.choice(faults)
            n_faults += 1
        elif x < 0.55:
            ln = TRAIN.format(r=rng.randrange(1024), s=rng.randrange(200000), l=rng.random() * 4,
                              lr=rng.random() * 1e-3, g=rng.random() * 2, t=rng.randrange(10**5, 10**6))
        elif x < 0.85:
            ln = rng.choice(NCCL_INFO).format(h=f"gpu-node-{rng.randrange(128):03d}", p=rng.randrange(10**6),
                                              d=rng.randrange(8), e=rng.randrange(8), c=rng.randrange(32),
                                              r=rng.randrange(1024))
        else:
            ln = rng.choice(KERNEL).format(ts=rng.random() * 10**6, c=rng.randrange(1000),
                                           p=rng.randrange(10**5), d=rng.randrange(8))
        lines.append(ln)
        size += len(ln) + 1
    return lines, n_faults


class Run(NamedTuple):
    """One timed run."""

    cpu: float
    """CPU seconds of this process: what the run cost one core, whatever else the machine ran meanwhile."""
    wall: float
    """Elapsed seconds."""
    found: int
    """Findings (or raw hits) it produced."""


def _timer() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _since(start: tuple[float, float], found: int) -> Run:
    return Run(time.process_time() - start[0], time.perf_counter() - start[1], found)


def run_lines(engine: MultiMatcher | NaiveMatcher, lines: Sequence[str], batch: int) -> Run:
    """Time to turn a list of lines into findings, and how many findings."""
    found = 0
    t0 = _timer()
    for i in range(0, len(lines), batch):
        chunk = lines[i:i + batch]
        for hit in engine.scan(chunk):
            line = LogLine(text=chunk[hit.line])
            sig = Signal(id=f"bench:{i + hit.line}", node="bench", source=Source.CONTAINER,
                         ts=float(i + hit.line), payload=line)
            finding_from_match(hit.rule, sig, line, hit.groups)
            found += 1
    return _since(t0, found)


def run_buffer(engine: MultiMatcher, data: bytes, chunk: int) -> Run:
    """Time to turn a log file's bytes into findings (chunks cut at newlines), and how many."""
    found = 0
    t0 = _timer()
    pos = 0
    while pos < len(data):
        stop = data.find(b"\n", min(pos + chunk, len(data)))
        stop = len(data) if stop < 0 else stop + 1
        for hit in engine.scan_buffer(data[pos:stop] if (pos, stop) != (0, len(data)) else data):
            line = LogLine(text=hit.text)
            sig = Signal(id=f"bench:{pos + hit.start}", node="bench", source=Source.CONTAINER,
                         ts=float(pos + hit.start), payload=line)
            finding_from_match(hit.rule, sig, line, hit.groups)
            found += 1
        pos = stop
    return _since(t0, found)


def _signals(lines: Sequence[str], first: int) -> list[Signal]:
    # Times start at 1: the service refuses a signal at time 0.
    return [Signal(id=f"bench:{first + k}", node="bench", source=Source.CONTAINER, ts=float(first + k + 1),
                   payload=LogLine(text=ln)) for k, ln in enumerate(lines)]


def agent_bodies(lines: Sequence[str], batch: int) -> list[bytes]:
    """The log mix as the agent ships it: ``POST /v1/signals`` bodies of ``batch`` log signals, as the service
    reads them once un-gzipped (the agent's own encoder, numbered batches)."""
    return [gzip.decompress(encode_batch(_signals(lines[i:i + batch], i), producer="bench", seq=i // batch + 1))
            for i in range(0, len(lines), batch)]


def run_service(matcher: FastMatcher, bodies: Sequence[bytes], *, as_bytes: bool) -> Run:
    """Time for ingest's call into the engine: ``FastMatcher.match`` on each batch as the service decoded it.

    Each body is decoded by the service's own decoder (``decode_fast``, as ``POST /v1/signals`` does) just
    before its batch is matched, so the batch's objects are as fresh in memory as they are in the service;
    the decoding is not timed. ``as_bytes``: ``match_lines`` instead, given the batch's lines as one buffer
    (built untimed); ingest does not call it (no buffer of a batch's lines exists there).
    """
    found = 0
    cpu = wall = 0.0
    for body in bodies:
        decoded = decode_fast(body)
        assert decoded is not None, "the service's decoder refused the agent's body"
        signals = decoded[0]
        data = "\n".join(decoded[0].texts).encode() if as_bytes else None
        t0 = _timer()
        found += len(matcher.match(signals) if data is None else matcher.match_lines(signals, data))
        cpu += time.process_time() - t0[0]
        wall += time.perf_counter() - t0[1]
    return Run(cpu, wall, found)


def run_raw_hyperscan(engine: MultiMatcher, data: bytes) -> Run:
    """Time for hyperscan alone to report every hit in the bytes (no line mapping, no confirmation).

    The floor the file path is measured against: what is left is the cost of confirming
    and extracting with RE2 and of building findings.
    """
    hits = 0

    def on_match(_id: int, _start: int, _end: int, _flags: int, _ctx: object) -> None:
        nonlocal hits
        hits += 1

    t0 = _timer()
    engine._hs.scan(data, match_event_handler=on_match)  # the bench reads the engine's own database
    return _since(t0, hits)


def main() -> int:
    ap = argparse.ArgumentParser(description="rule engine throughput")
    ap.add_argument("--mb", type=float, default=200.0, help="size of the generated mix")
    ap.add_argument("--naive-mb", type=float, default=4.0, help="subset the naive loop runs on")
    ap.add_argument("--batch", type=int, default=65536, help="lines per scan on the line-list path")
    ap.add_argument("--service-batch", type=int, default=1000,
                    help="signals per batch on the service path (the agent ships 1,000 lines)")
    ap.add_argument("--chunk-mb", type=float, default=256.0, help="megabytes per scan on the file path")
    ap.add_argument("--backend", choices=[b.value for b in Backend], default=None)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every engine; the fastest is reported")
    args = ap.parse_args()

    rules = load_rules([default_rules_dir()])
    lines, n_faults = generate(rules, int(args.mb * 1e6))
    data = "\n".join(lines).encode()
    backend = Backend(args.backend) if args.backend else available_backends()[0]
    common = {"bench": "rules", "rules": len(rules), "python": platform.python_version(),
              "machine": platform.machine(), "cpu_count": os.cpu_count(), "threads": 1,
              "fault_lines": n_faults}
    engine = MultiMatcher(rules, backend=backend)

    def emit(name: str, nbytes: int, nlines: int, run: Run, **extra: object) -> None:
        print(json.dumps({**common, "engine": name, "bytes": nbytes, "lines": nlines, "findings": run.found,
                          "cpu_seconds": round(run.cpu, 4), "seconds": round(run.wall, 4),
                          "mb_per_s_per_core": round(nbytes / 1e6 / run.cpu, 2),
                          "lines_per_s_per_core": round(nlines / run.cpu), **extra}), flush=True)

    # Rounds interleave the engines, so a burst of load from other processes hits all of them alike.
    # Each is timed in CPU seconds of this process (a shared machine preempts it at random; CPU time
    # leaves that out) and the fastest round counts; its ratio to raw hyperscan is the figure to compare.
    matcher = FastMatcher(rules, backend=backend)
    bodies = agent_bodies(lines, args.service_batch)
    rounds: dict[str, list[Run]] = {"file": [], "lines": [], "raw": [], "service": [], "service-bytes": []}
    for _ in range(max(args.repeat, 1)):
        if backend is Backend.HYPERSCAN:
            rounds["raw"].append(run_raw_hyperscan(engine, data))
        rounds["file"].append(run_buffer(engine, data, int(args.chunk_mb * 1e6)))
        rounds["lines"].append(run_lines(engine, lines, args.batch))
        rounds["service"].append(run_service(matcher, bodies, as_bytes=False))
        rounds["service-bytes"].append(run_service(matcher, bodies, as_bytes=True))

    def fastest(name: str) -> Run:
        return min(rounds[name])

    def vs_raw(name: str) -> dict[str, object]:
        if not rounds["raw"]:
            return {}
        per_round = sorted(raw.cpu / run.cpu for raw, run in zip(rounds["raw"], rounds[name], strict=True))
        return {"ratio_to_raw": round(fastest("raw").cpu / fastest(name).cpu, 3),
                "ratio_to_raw_median_round": round(per_round[len(per_round) // 2], 3),
                "ratio_to_raw_wall": round(min(r.wall for r in rounds["raw"]) / min(r.wall for r in rounds[name]), 3)}

    emit(f"multi-pattern/{backend.value}", len(data), len(lines), fastest("file"), input="file bytes",
         repeat=len(rounds["file"]), statistic="fastest", **vs_raw("file"))
    emit(f"multi-pattern/{backend.value}", len(data), len(lines), fastest("lines"), input="list of str lines",
         repeat=len(rounds["lines"]), statistic="fastest", **vs_raw("lines"))
    emit("FastMatcher.match (service path)", len(data), len(lines), fastest("service"),
         input=f"POST /v1/signals bodies of {args.service_batch} log signals from the agent's encoder, each decoded "
               "by the service's decoder (decode_fast) just before it is matched, untimed",
         measures="FastMatcher.match(signals) per batch: the call Analyzer.process makes for every ingested batch",
         repeat=len(rounds["service"]), statistic="fastest", **vs_raw("service"))
    emit("FastMatcher.match_lines (received bytes; not ingest's call)", len(data), len(lines),
         fastest("service-bytes"),
         input=f"the same decoded batches of {args.service_batch} and their lines joined into one buffer, untimed",
         measures="FastMatcher.match_lines(signals, buffer) per batch: ingest never has such a buffer",
         repeat=len(rounds["service-bytes"]), statistic="fastest", **vs_raw("service-bytes"))
    if rounds["raw"]:
        emit("raw hyperscan (hits only)", len(data), len(lines), fastest("raw"), input="file bytes",
             repeat=len(rounds["raw"]), statistic="fastest", note="findings = raw hits, before lines and confirmation")

    if rounds["raw"]:
        # The figures to quote: each path's CPU time against raw hyperscan's over the same bytes, in this run.
        print(json.dumps({**common, "summary": "ratio to raw hyperscan, same run", "bytes": len(data),
                          "file_path": vs_raw("file")["ratio_to_raw"],
                          "service_path": vs_raw("service")["ratio_to_raw"],
                          "service_path_measures": "FastMatcher.match(signals), Analyzer.process's call per "
                                                   "POST /v1/signals batch, on the service's decoded batches",
                          "service_path_received_bytes": vs_raw("service-bytes")["ratio_to_raw"],
                          "line_list_path": vs_raw("lines")["ratio_to_raw"],
                          "median_round": {"file_path": vs_raw("file")["ratio_to_raw_median_round"],
                                           "service_path": vs_raw("service")["ratio_to_raw_median_round"]},
                          "targets": {"file_path": 0.8, "service_path": 0.5}}), flush=True)

    sub: list[str] = []
    sub_bytes = 0
    for ln in lines:
        if sub_bytes >= args.naive_mb * 1e6:
            break
        sub.append(ln)
        sub_bytes += len(ln) + 1
    emit("naive per-line per-rule search (each rule's RE2 regex)", sub_bytes, len(sub),
         run_lines(NaiveMatcher(rules), sub, args.batch),
         input="list of str lines", measured_on_subset=len(sub) < len(lines),
         note="rate measured on the first bytes of the same mix and applies to all of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
