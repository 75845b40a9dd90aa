"""Small builders for signals used across tests."""

from __future__ import annotations

import itertools

from collector.signal import LogLine, Signal, Source

_seq = itertools.count(1)


def kernel(node: str, text: str, ts: float = 1_700_000_000.0) -> Signal:
    """A kernel-log line from `node`."""
    return Signal(f"{node}/kernel/{next(_seq)}", node, Source.KERNEL, ts, LogLine(text))


def container(node: str, text: str, *, job: str | None = "job-a", rank: int | None = None,
              ts: float = 1_700_000_000.0, pod: str | None = None, namespace: str = "training") -> Signal:
    """A container-log line from a training pod on `node` (in `namespace`, as the CRI log path names it)."""
    pod = pod or f"{job or 'pod'}-{node}"
    return Signal(f"{node}/container/{pod}/{next(_seq)}", node, Source.CONTAINER, ts,
                  LogLine(text, namespace=namespace, pod=pod, container="trainer", job=job, rank=rank))


def nccl_timeout(rank: int, seq: int = 1580) -> str:
    """The PyTorch watchdog line a rank prints on a collective timeout (real format)."""
    return (f"[rank{rank}]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank {rank}] Watchdog caught "
            f"collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=466119168, "
            f"NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.")


XID79 = "[ 8123.450001] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."
XID13 = ("[139600.598066] NVRM: Xid (PCI:0000:05:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 0): "
         "Out Of Range Address")
