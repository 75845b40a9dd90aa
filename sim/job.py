"""Simulated training jobs that write realistic per-rank container log lines."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from collector.signal import LogLine, Signal, Source

DGX_PCI_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
"""PCI buses of the eight GPUs of a DGX H100-style node, by GPU index."""


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one rank of a job runs."""

    rank: int
    """Global rank."""
    node: str
    """Node name."""
    pod: str
    """Pod name."""
    gpu: int
    """Local GPU index on the node."""


@dataclass
class TrainingJob:
    """A data-parallel job, one pod per node, one rank per GPU, Megatron-style logs."""

    name: str
    nodes: Sequence[str]
    ranks_per_node: int = 8
    namespace: str = "training"
    step_time_s: float = 1.2
    train_iters: int = 500000
    seed: int = 7
    _offsets: dict[str, int] = field(default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.nodes) * self.ranks_per_node

    def placements(self) -> list[RankPlacement]:
        """Rank → node/pod/GPU."""
        out = []
        for i, node in enumerate(self.nodes):
            for g in range(self.ranks_per_node):
                out.append(RankPlacement(i * self.ranks_per_node + g, node, f"{self.name}-worker-{i}", g))
        return out

    def _signal(self, p: RankPlacement, ts: float, text: str) -> Signal:
        key = f"{p.node}/container/{self.namespace}_{p.pod}/rank{p.rank}"
        off = self._offsets.get(key, 0)
        self._offsets[key] = off + 1
        line = LogLine(text=text, namespace=self.namespace, pod=p.pod, container="trainer",
                       job=self.name, rank=p.rank)
        return Signal(id=f"{key}/{off}", node=p.node, source=Source.CONTAINER, ts=ts, payload=line)

    def step(self, it: int, ts: float) -> list[Signal]:
        """Every rank's log line for iteration `it` (Megatron-LM format)."""
        out = []
        for p in self.placements():
            ms = self.step_time_s * 1000 * (1 + self._rng.uniform(-0.02, 0.02))
            loss = 2.9 * (0.9995 ** it) + self._rng.uniform(-0.01, 0.01)
            text = (f"[rank{p.rank}]:  iteration {it:8d}/{self.train_iters:8d} | consumed samples: "
                    f"{it * 1024:12d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: "
                    f"3.000E-04 | global batch size:  1024 | lm loss: {loss:.6E} | loss scale: 1.0 | "
                    f"grad norm: 0.{self._rng.randint(100, 999)} | number of skipped iterations:   0 | "
                    f"number of nan iterations:   0 |")
            out.append(self._signal(p, ts, text))
        return out

    def nccl_timeouts(self, ts: float, seq: int, *, skip_nodes: Sequence[str] = ()) -> list[Signal]:
        """The watchdog timeout every surviving rank prints when a peer stops answering."""
        out = []
        stamp = time.strftime("%m%d %H:%M:%S", time.gmtime(ts))
        for p in self.placements():
            if p.node in skip_nodes:
                continue
            text = (f"[rank{p.rank}]:[E{stamp}.{self._rng.randint(0, 999999):06d} ProcessGroupNCCL.cpp:607] "
                    f"[Rank {p.rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, "
                    f"OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for "
                    f"{600000 + self._rng.randint(5, 99)} milliseconds before timing out.")
            out.append(self._signal(p, ts + self._rng.uniform(0, 2), text))
        return out
