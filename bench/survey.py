"""What a stack survey costs the training process it samples, and the agent.

    python bench/survey.py [--rounds 3] [--seconds 6]

One CPU training loop (a 2-layer MLP, forward, backward and SGD step on one thread, counting
steps in shared memory) runs as its own process. Rounds alternate, each `--seconds` long: with
nothing sampling it, then with ``py-spy record --nonblocking --idle --rate 100`` sampling it back to
back in 2 s surveys (the agent's survey, every second of the round instead of 2 s every 10 s: the
worst case, 5x the default duty). Reported: the loop's steps per second in each kind of round (the
same run, interleaved), their ratio, and py-spy's CPU seconds per 2 s survey (the agent's cost per
rank). One JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector.survey import PySpyProfiler, main_thread_places


def _loop(counter: Any) -> None:
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(128, 256)
    while True:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with counter.get_lock():
            counter.value += 1


def _children_cpu() -> float:
    """CPU seconds of the children waited for: each py-spy run (the training loop is reaped only at the end)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    binary = str(Path(sys.executable).parent / "py-spy")
    counter = mp.Value("l", 0)
    proc = mp.get_context("fork").Process(target=_loop, args=(counter,), daemon=True)
    proc.start()
    assert proc.pid is not None
    deadline = time.monotonic() + 90.0  # torch's import and warm-up: seconds, minutes on a loaded machine
    while counter.value < 50 and time.monotonic() < deadline and proc.is_alive():
        time.sleep(0.2)
    if counter.value < 50:
        proc.kill()
        sys.exit(f"the training loop did not start within 90 s ({counter.value} steps)")
    rates: dict[str, list[float]] = {"off": [], "on": []}
    surveys, spy_cpu, samples = 0, 0.0, []
    failed: list[str] = []
    profiler = PySpyProfiler(binary)
    try:
        for _ in range(args.rounds):
            for kind in ("off", "on"):
                start_steps, t0 = counter.value, time.monotonic()
                while time.monotonic() - t0 < args.seconds:
                    if kind == "on":
                        before = _children_cpu()
                        try:
                            raw = profiler.profile(proc.pid, 2, 100)
                        except RuntimeError as exc:  # reported, as the agent logs it; the round goes on
                            failed.append(str(exc)[:200])
                            continue
                        spy_cpu += _children_cpu() - before
                        surveys += 1
                        samples.append(sum(main_thread_places(raw, proc.pid).values()))
                    else:
                        time.sleep(0.2)
                rates[kind].append((counter.value - start_steps) / (time.monotonic() - t0))
    finally:
        proc.kill()
        proc.join()
    off, on = median(rates["off"]), median(rates["on"])
    print(json.dumps({
        "bench": "survey", "rounds": args.rounds, "round_s": args.seconds, "cpu_count": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
        "steps_per_s_unsampled": [round(r, 1) for r in rates["off"]],
        "steps_per_s_sampled": [round(r, 1) for r in rates["on"]],
        "sampled_over_unsampled_median": round(on / off, 3) if off > 0 else None,
        "surveys": surveys, "failed_surveys": failed[:3],
        "py_spy_cpu_s_per_survey": round(spy_cpu / max(surveys, 1), 4),
        "main_thread_samples_per_survey": median(samples) if samples else 0,
        "note": "surveys back to back while sampled (5x the agent's default duty of 2 s every 10 s)",
    }))


if __name__ == "__main__":
    main()
