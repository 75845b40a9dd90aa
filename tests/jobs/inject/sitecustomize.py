"""Faults injected into an unmodified training process from outside, through its PYTHONPATH.

Python imports ``sitecustomize`` at start-up. Acting only in the process whose ``RANK``
equals ``KMEND_FAULT_RANK``, after ``KMEND_FAULT_AFTER`` optimizer steps:

- ``KMEND_FAULT=slow``: sleep ``KMEND_FAULT_SLOW_S`` after every optimizer step (a slow rank);
- ``KMEND_FAULT=slow_forward``: sleep ``KMEND_FAULT_SLOW_S`` before every forward pass (slow work before the
  gradient all-reduce: its peers wait in it, and every rank logs the step at the same moment);
- ``KMEND_FAULT=stop``: stop the process with SIGSTOP at its next forward pass (a rank that
  hangs while its peers wait in the gradient all-reduce);
- ``KMEND_FAULT=crash``: raise at the next optimizer step (an application bug on one rank);
- ``KMEND_FAULT=stall_loader``: once, after ``KMEND_FAULT_AFTER`` batches, the data loader's fetch of the next
  batch takes ``KMEND_FAULT_STALL_S`` seconds (storage that stalls, then recovers: a slow job, not a hung one);
- ``KMEND_FAULT=deadlock``: at its next forward pass the process blocks for good on a lock another of its threads
  holds (a deadlock in the job's own code: the process sleeps, uses no CPU and is never stopped);
- ``KMEND_FAULT=spin``: at its next forward pass the process spins on a flag that is never set (``while not
  flag: pass``: a deadlock in the job's own code that keeps a CPU busy, its stack the same at every look);
- ``KMEND_FAULT=load``: at its first forward pass it spends ``KMEND_FAULT_LOAD_S`` seconds decoding records on its
  CPU (a slow data load before the first step: busy, its stack changing), then trains on.
"""

from __future__ import annotations

import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("KMEND_FAULT_RANK"):
    import signal
    import threading
    import time

    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _fault = os.environ["KMEND_FAULT"]
    _after = int(os.environ.get("KMEND_FAULT_AFTER", "0"))
    _slow_s = float(os.environ.get("KMEND_FAULT_SLOW_S", "0"))
    _steps = [0]

    def _post(_opt: object, _args: object, _kwargs: object) -> None:
        _steps[0] += 1
        if _steps[0] <= _after:
            return
        if _fault == "slow":
            time.sleep(_slow_s)
        elif _fault == "crash":
            raise ValueError(f"injected failure on rank {os.environ['RANK']} at step {_steps[0]}")

    _forwards = [0]

    def _deadlock() -> None:
        held, taken = threading.Lock(), threading.Event()

        def _holder() -> None:
            with held:
                taken.set()
                threading.Event().wait()  # keeps the lock for good

        threading.Thread(target=_holder, name="holder", daemon=True).start()
        taken.wait()
        held.acquire()

    _flag = [False]

    def _spin() -> None:
        while not _flag[0]:
            pass

    def _load(seconds: float) -> None:
        import json
        import random

        end = time.monotonic() + seconds
        records = [{"id": i, "text": "x" * random.randint(1, 200)} for i in range(2000)]
        while time.monotonic() < end:
            json.loads(json.dumps(records))
            sorted(records, key=lambda r: (len(r["text"]), r["id"]))

    def _forward(_module: object, _inputs: object) -> None:
        if _fault == "stop" and _steps[0] >= _after:
            os.kill(os.getpid(), signal.SIGSTOP)
        if _fault == "deadlock" and _steps[0] >= _after:
            _deadlock()
        if _fault == "spin" and _steps[0] >= _after:
            _spin()
        if _fault == "load" and not _forwards[0]:
            _forwards[0] = 1
            _load(float(os.environ["KMEND_FAULT_LOAD_S"]))
        if _fault == "slow_forward" and _steps[0] >= _after and _forwards[0] < _steps[0]:
            _forwards[0] = _steps[0]  # once per step: the hook runs for every submodule's forward
            time.sleep(_slow_s)

    register_optimizer_step_post_hook(_post)
    register_module_forward_pre_hook(_forward)

    if _fault == "stall_loader":
        from torch.utils.data import dataloader

        _fetch = dataloader._SingleProcessDataLoaderIter._next_data
        _batches = [0]

        def _slow_fetch(self: object) -> object:
            _batches[0] += 1
            if _batches[0] == _after + 1:
                time.sleep(float(os.environ["KMEND_FAULT_STALL_S"]))
            return _fetch(self)  # type: ignore[arg-type]

        dataloader._SingleProcessDataLoaderIter._next_data = _slow_fetch  # type: ignore[method-assign]
