"""What ``py-spy dump`` shows of a simulated job's ranks when the service asks for stacks in a silence.

The service asks once a job has been silent for ``suspect_fraction`` of its hang threshold (its detectors
run every second) and the node agent answers 1-3 s later (its poll, then ``py-spy dump`` of each rank).
What the ranks are doing at that instant follows from the job's timeline, step by step (each step: the
batch fetch, with a data-loader stall on one rank; then an unannounced stall on one rank; then compute):

- a data-loader stall: that rank in its DataLoader iterator waiting on the worker queue, the others, once
  they finished their own forward and backward, in the all-reduce waiting for it;
- an unannounced stall (a slow shard, garbage collection, or a hang of unknown cause): that rank in its own
  code, the others in the all-reduce;
- compute: every rank in its forward (model code), then in backward (autograd, where DDP's all-reduce runs).

A hang of the fleet's screen check (``stall_s``) is an unannounced stall that does not end: the same picture.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HEAD = "Process {pid}: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
_MAIN = 'Thread {pid} (idle): "MainThread"\n'
LOADER = ("wait (threading.py:331)", "get (queue.py:180)", "_try_get_data (torch/utils/data/dataloader.py:1133)",
          "_get_data (torch/utils/data/dataloader.py:1294)", "_next_data (torch/utils/data/dataloader.py:1332)",
          "__next__ (torch/utils/data/dataloader.py:631)", "train (train.py:40)", "<module> (train.py:80)")
ALL_REDUCE = ("_engine_run_backward (torch/autograd/graph.py:768)", "backward (torch/autograd/__init__.py:289)",
              "backward (torch/_tensor.py:521)", "train (train.py:46)", "<module> (train.py:80)")
OWN_CODE = ("read_shard (shards.py:88)", "train (train.py:43)", "<module> (train.py:80)")
FORWARD = ("forward (model.py:30)", "_call_impl (torch/nn/modules/module.py:1527)", "train (train.py:44)",
           "<module> (train.py:80)")


def text(pid: int, frames: Sequence[str]) -> str:
    """A dump as py-spy prints it: the process, then the main thread's frames, innermost first."""
    return HEAD.format(pid=pid) + _MAIN.format(pid=pid) + "".join(f"    {f}\n" for f in frames)


def capture_delay(i: int) -> float:
    """Seconds from the suspicion to the stacks for the silence after report `i`: the next detector round
    (0-1 s), then the agent's poll and py-spy (1-3 s). Drawn from `i` alone, so any replay gets the same."""
    rng = np.random.default_rng(i)
    return float(rng.uniform(0.0, 1.0) + rng.uniform(1.0, 3.0))


def picture(world: int, silence_at: float, steps: tuple[np.ndarray, np.ndarray, np.ndarray], first: int,
            t: float) -> dict[int, tuple[str, ...]]:
    """Every rank's frames `t` seconds into the steps that start at step `first` (base, loader and unannounced
    stall seconds per step), `silence_at` seconds of other waiting (a pause) before them; {} while in it."""
    base, loader, stall = steps
    t -= silence_at
    if t < 0:
        return {}
    j = first
    while j < len(base):
        if t < loader[j]:
            busy = j * 7919 % world
            others = ALL_REDUCE if t >= base[j] else FORWARD
            return {r: LOADER if r == busy else others for r in range(world)}
        t -= loader[j]
        if t < stall[j]:
            busy = j * 104729 % world
            others = ALL_REDUCE if t >= base[j] else FORWARD
            return {r: OWN_CODE if r == busy else others for r in range(world)}
        t -= stall[j]
        if t < base[j]:
            return {r: FORWARD if t < 0.4 * base[j] else ALL_REDUCE for r in range(world)}
        t -= base[j]
        j += 1
    return {}
