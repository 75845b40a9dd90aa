"""A tiny data-parallel training job for the torchrun tests (gloo, CPU).

Each step: forward and backward on a small MLP, a log line, then the gradient
all-reduce and the optimizer step; the step is also reported through kmend's
progress hook with its compute and communication-wait phases. Behaviour is set by
environment variables: KMEND_TEST_SLOW_RANK/KMEND_TEST_SLOW_S (that rank sleeps in
compute every step), KMEND_TEST_HANG_RANK/KMEND_TEST_HANG_STEP (that rank blocks
before that step; with KMEND_TEST_HANG_WHERE=collective it logs the step first and
blocks before the gradient all-reduce, so every rank logs the same last step and the
others wait inside it), KMEND_TEST_STEPS, KMEND_TEST_GLOO_TIMEOUT_S,
KMEND_TEST_LOG_DIR (per-rank log files, as a container log would hold them),
and KMEND_TEST_FR_DIR (Flight Recorder dumps written when a collective fails).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from collector.progress_hook import report_step


def main() -> None:
    env = os.environ
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(env["KMEND_TEST_GLOO_TIMEOUT_S"])))
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    log = open(Path(env["KMEND_TEST_LOG_DIR"]) / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115
    # Enough work per step (tens of ms) that CPU time-slicing between the ranks is small beside it.
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    slow_rank, slow_s = int(env.get("KMEND_TEST_SLOW_RANK", "-1")), float(env.get("KMEND_TEST_SLOW_S", "0"))
    hang_rank, hang_step = int(env.get("KMEND_TEST_HANG_RANK", "-1")), int(env.get("KMEND_TEST_HANG_STEP", "-1"))
    in_collective = env.get("KMEND_TEST_HANG_WHERE") == "collective"
    try:
        last = time.monotonic()
        for step in range(1, int(env["KMEND_TEST_STEPS"]) + 1):
            if rank == hang_rank and step == hang_step and not in_collective:
                time.sleep(3600)  # stuck before its next collective (a data loader that never returns)
            t0 = time.monotonic()
            x = torch.randn(1024, 256)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if rank == slow_rank:
                time.sleep(slow_s)
            compute = time.monotonic() - t0
            log.write(f"step {step} loss {loss.item():.4f} step_time={time.monotonic() - last:.4f}\n")
            if rank == hang_rank and step == hang_step and in_collective:
                time.sleep(3600)  # its peers are already inside the all-reduce below
            t1 = time.monotonic()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            now = time.monotonic()
            report_step(step, now - last, {"compute": compute, "comm_wait": now - t1})
            last = now
            time.sleep(0.02)
    except Exception:
        log.write(traceback.format_exc())
        fr_dir = env.get("KMEND_TEST_FR_DIR")
        if fr_dir:
            from torch._C._distributed_c10d import _dump_fr_trace

            (Path(fr_dir) / f"rank{rank}").write_bytes(_dump_fr_trace())
        log.close()
        sys.exit(1)
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
