"""Multi-rank training traces with ground truth, for the detectors' tests and ``bench/detect.py``.

A synchronous data-parallel job: every step each rank computes (its own speed,
per-step jitter, rare data-loader hiccups), then all ranks meet in the gradient
all-reduce, so the step ends when the slowest rank arrives. Each rank reports its
step through the progress hook (step time and phases: ``compute`` and
``comm_wait``); optionally each node reports GPU utilisation. Faults bend this
timeline the way real ones do: a lost GPU stops every rank and, a watchdog
timeout later, every rank prints the NCCL timeout; a silently hung rank stops
and the others wait in the collective; a straggler computes slower; a bug
crashes every rank with the same error.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from collector.signal import LogLine, MetricSample, ProgressSample, Signal, Source
from sim.faults import KernelLog

Batch = tuple[float, list[Signal]]
"""Signals that become visible at one time (the time is when an agent would ship them)."""


@dataclass(frozen=True, slots=True)
class Straggle:
    """One rank computing slower from some step on."""

    rank: int
    """The slow rank."""
    factor: float
    """Slowdown of its compute (1.10 = 10% slower)."""
    from_step: int
    """First slow step."""


@dataclass(frozen=True, slots=True)
class Load:
    """A loaded machine: every rank's compute slowed at once, each by its own factor, for a few steps."""

    from_step: int
    """First loaded step."""
    steps: int
    """Loaded steps."""
    low: float
    """Smallest slowdown a rank gets in a loaded step."""
    high: float
    """Largest slowdown a rank gets in a loaded step."""


@dataclass
class TraceJob:
    """A simulated job's timeline, step by step, as signals."""

    name: str
    world: int
    ranks_per_node: int = 8
    step_s: float = 1.0
    """Compute seconds per step of a typical rank."""
    comm_s: float = 0.15
    """All-reduce seconds once every rank has arrived."""
    jitter: float = 0.03
    """Per-step compute noise (relative standard deviation)."""
    spread: float = 0.005
    """Fixed per-rank speed differences (relative standard deviation): no two GPUs are identical."""
    hiccup_p: float = 0.0005
    """Chance per rank and step of a data-loader hiccup: one step 1.5-3x longer."""
    hiccup_s: tuple[float, float] | None = None
    """With it, a hiccup adds this many seconds (uniform) instead: an I/O stall does not scale with the step."""
    report_delay_s: float = 0.05
    """Up to this much delay between a step ending and its report being shipped."""
    gpu_metrics: bool = False
    """Whether nodes report GPU utilisation (every `metric_every` steps)."""
    metric_every: int = 5
    seed: int = 0
    ts: float = 1_700_000_000.0
    """Current time of the timeline."""
    step: int = 0
    """Last completed step."""
    _rng: random.Random = field(init=False)
    _speed: list[float] = field(init=False)
    _seq: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._speed = [1.0 + self._rng.gauss(0.0, self.spread) for _ in range(self.world)]

    def node_of(self, rank: int) -> str:
        """Node of a rank (ranks fill nodes in order)."""
        return f"{self.name}-n{rank // self.ranks_per_node:03d}"

    @property
    def nodes(self) -> list[str]:
        """The job's nodes."""
        return [self.node_of(r) for r in range(0, self.world, self.ranks_per_node)]

    def _sid(self, kind: str) -> str:
        self._seq += 1
        return f"{self.name}/{kind}/{self._seq}"

    def progress(self, rank: int, ts: float, step_time: float, compute: float) -> Signal:
        """One rank's hook report."""
        return Signal(self._sid("progress"), self.node_of(rank), Source.PROGRESS, ts,
                      ProgressSample(self.name, rank, self.step, step_time,
                                     {"compute": compute, "comm_wait": max(step_time - compute, 0.0)},
                                     namespace="training"))

    def log(self, rank: int, ts: float, text: str) -> Signal:
        """One rank's container log line."""
        return Signal(self._sid("log"), self.node_of(rank), Source.CONTAINER, ts,
                      LogLine(f"[rank{rank}]: {text}", namespace="training", pod=f"{self.name}-{rank}",
                              container="trainer", job=self.name, rank=rank))

    def utilisation(self, ts: float, idle: frozenset[int] = frozenset()) -> list[Signal]:
        """Per-GPU utilisation: 100% for every rank's GPU except `idle` ranks'."""
        return [Signal(self._sid("metric"), self.node_of(r), Source.DCGM, ts,
                       MetricSample("DCGM_FI_DEV_GPU_UTIL", 0.0 if r in idle else 100.0,
                                    {"gpu": str(r % self.ranks_per_node)}))
                for r in range(self.world)]

    def run(self, steps: int, *, straggle: Straggle | None = None, report_before_sync: bool = False,
            load: tuple[Load, ...] = ()) -> list[Batch]:
        """`steps` healthy (or straggling) steps, through the `load`s; one batch per step."""
        out: list[Batch] = []
        for _ in range(steps):
            out.append(self._one_step(straggle, report_before_sync, load))
        return out

    def _compute(self, rank: int, straggle: Straggle | None, load: tuple[Load, ...] = ()) -> float:
        c = self.step_s * self._speed[rank] * max(1.0 + self._rng.gauss(0.0, self.jitter), 0.5)
        if self._rng.random() < self.hiccup_p:
            c = c + self._rng.uniform(*self.hiccup_s) if self.hiccup_s else c * self._rng.uniform(1.5, 3.0)
        if straggle is not None and rank == straggle.rank and self.step + 1 >= straggle.from_step:
            c *= straggle.factor
        for ld in load:
            if ld.from_step <= self.step < ld.from_step + ld.steps:
                c *= self._rng.uniform(ld.low, ld.high)
        return c

    def _one_step(self, straggle: Straggle | None, report_before_sync: bool, load: tuple[Load, ...] = ()) -> Batch:
        self.step += 1
        start = self.ts
        compute = [self._compute(r, straggle, load) for r in range(self.world)]
        end = start + max(compute) + self.comm_s
        sigs = []
        for r in range(self.world):
            at = (start + compute[r]) if report_before_sync else end
            sigs.append(self.progress(r, at + self._rng.uniform(0, self.report_delay_s), end - start, compute[r]))
        if self.gpu_metrics and self.step % self.metric_every == 0:
            sigs.extend(self.utilisation(end))
        self.ts = end
        return end + self.report_delay_s, sigs

    def pause(self, seconds: float) -> list[Batch]:
        """A checkpoint: rank 0 announces it (Megatron's lines), every rank waits, then steps resume."""
        start = self.ts
        self.ts += seconds
        return [(start, [self.log(0, start, f"saving checkpoint at iteration {self.step:7d} to /ckpt/{self.name}")]),
                (self.ts, [self.log(0, self.ts, f"  successfully saved checkpoint at iteration {self.step:7d} to "
                                                 f"/ckpt/{self.name}")])]

    def hang_rank(self, rank: int, *, behind: bool, duration_s: float) -> list[Batch]:
        """`rank` stops before its next step. With `behind`, the others report the step it never did
        (their report precedes the gradient sync); GPU utilisation shows it idle and the rest busy."""
        out: list[Batch] = []
        if behind:
            self.step += 1
            start = self.ts
            sigs = [self.progress(r, start + self._compute(r, None), self.step_s, self.step_s)
                    for r in range(self.world) if r != rank]
            self.step -= 1
            out.append((start + self.step_s * 1.2, sigs))
        t = self.ts + self.step_s
        while self.gpu_metrics and t < self.ts + duration_s:
            out.append((t, self.utilisation(t, idle=frozenset({rank}))))
            t += self.step_s * self.metric_every
        return out

    def nccl_timeouts(self, ts: float, seq: int, *, skip: frozenset[int] = frozenset()) -> Batch:
        """The watchdog line of every rank but `skip` (real PyTorch format)."""
        stamp = time.strftime("%m%d %H:%M:%S", time.gmtime(ts))
        sigs = [self.log(r, ts + self._rng.uniform(0, 2),
                         f"[E{stamp}.{self._rng.randint(0, 999999):06d} ProcessGroupNCCL.cpp:607] [Rank {r}] "
                         f"Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, "
                         f"NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600061 milliseconds "
                         f"before timing out.")
                for r in range(self.world) if r not in skip]
        return ts + 2.0, sigs

    def gloo_timeouts(self, ts: float, *, skip: frozenset[int] = frozenset()) -> Batch:
        """Gloo's timeout line on every rank but `skip` (as PyTorch 2.13 prints it from a waiting all-reduce)."""
        return ts + 1.0, [self.log(r, ts + self._rng.uniform(0, 1),
                                   "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                                   "unbound_buffer.cc:78] Timed out waiting 1800000ms for recv operation to complete")
                          for r in range(self.world) if r not in skip]

    def finish(self) -> Batch:
        """The run ends normally: rank 0 prints the Hugging Face Trainer's final metrics dict."""
        ts = self.ts + 0.5
        return ts, [self.log(0, ts, "{'train_runtime': 116.1914, 'train_samples_per_second': 6.885, "
                                    "'train_steps_per_second': 1.721, 'train_loss': 2.819730052947998, 'epoch': 0.15}")]

    def terminated(self) -> Batch:
        """The job is deleted: each node's torchrun gets SIGTERM and says so before stopping its workers."""
        ts = self.ts + 0.5
        return ts, [self.log(r, ts, "W1130 12:13:49.388000 124326 torch/distributed/elastic/agent/server/api.py:723] "
                                    "Received 15 death signal, shutting down workers")
                    for r in range(0, self.world, self.ranks_per_node)]

    def pods_gone(self, after_s: float = 5.0) -> Batch:
        """Every rank's pod is removed (deleted, or replaced for a restart): the agent reports each container gone."""
        self.ts += after_s
        return self.ts, [Signal(self._sid("exit"), self.node_of(r), Source.CONTAINER, self.ts,
                                ProgressSample(self.name, r, 0, event="exit", namespace="training"))
                                for r in range(self.world)]

    def resume_from(self, step: int, after_s: float) -> None:
        """New pods load the checkpoint of `step` and go on from there, `after_s` later."""
        self.ts += after_s
        self.step = step

    def app_error(self, ts: float) -> Batch:
        """Every rank hits the same bug (an allocation the batch size cannot fit)."""
        return ts + 1.0, [self.log(r, ts + self._rng.uniform(0, 1),
                                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 "
                                   "has a total capacity of 79.11 GiB of which 12.73 GiB is free.")
                          for r in range(self.world)]

    def xid79(self, ts: float, rank: int) -> Batch:
        """The kernel line of the GPU under `rank` falling off the bus."""
        klog = KernelLog(self.node_of(rank), boot_ts=ts - 86400)
        return ts, klog.xid(ts, rank % self.ranks_per_node, 79)

    def flight_recorder_dumps(self, seq: int, missing: frozenset[int]) -> dict[int, dict[str, Any]]:
        """Per-rank Flight Recorder dumps: collectives 1..seq-1 done, `seq` enqueued by all but `missing`."""
        ranks = str(list(range(self.world)))
        out: dict[int, dict[str, Any]] = {}
        for r in range(self.world):
            top = seq - 1 if r in missing else seq
            entries = [{"record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": i,
                        "p2p_seq_id": 0, "op_id": i, "profiling_name": "nccl:all_reduce", "time_created_ns": i,
                        "input_sizes": [[1024]], "output_sizes": [[1024]], "state": "completed" if i < seq
                        else "scheduled", "retired": i < seq, "is_p2p": False, "timeout_ms": 600000, "frames": []}
                       for i in range(max(1, top - 20), top + 1)]
            out[r] = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
                      "pg_status": {"0": {"last_enqueued_collective": top, "last_completed_collective": seq - 1}},
                      "entries": entries}
        return out


def interleave(batches: list[Batch]) -> Iterator[Batch]:
    """Batches in the order they become visible."""
    yield from sorted(batches, key=lambda b: b[0])
