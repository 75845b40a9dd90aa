"""An ordinary DistributedDataParallel loop (gloo, CPU) that reports its steps through kmend's hook, as its
README shows: ``report_step(step, step_time)`` after ``optimizer.step()``, ``finish()`` after the last one. It
prints nothing per step. The number of steps comes from the command line; everything else is fixed."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from collector.progress_hook import finish, report_step


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                                        torch.nn.Linear(128, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    last = time.monotonic()
    for step in range(1, steps + 1):
        x = torch.randn(256, 128)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.monotonic()
        report_step(step, now - last)
        last = now
    finish(steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
