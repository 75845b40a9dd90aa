"""How much of a while each rank process could not run: stopped by a signal, or runnable but waiting for a CPU.

A rank slowed from outside (another process pinned to its CPU, a CPU quota, something stopping and continuing it)
runs the same code as its peers, only less of the time: a stack sample shows it in its own code either way. The
kernel knows better. ``/proc/<pid>/schedstat`` counts the nanoseconds the process's main thread spent runnable but
waiting on a run queue (its second field), and the state letter of ``/proc/<pid>/stat`` says whether it is stopped
(``T``, ``t``) at a given moment. Over a survey's window the agent reads the first at the start and the end and looks
at the second every `every_s`: the shares of the window spent waiting for a CPU and stopped go with the rank's stack
shares (``collector.survey``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from collector.processes import STOPPED_STATES, read_stat
from collector.sources.base import Clock


@dataclass(frozen=True, slots=True)
class SchedShares:
    """Where one process's window went, as the scheduler saw it."""

    cpu_wait: float
    """Share of the window the main thread was runnable but waited for a CPU (``schedstat``'s run delay)."""
    stopped: float
    """Share of the looks at the process that found it stopped (SIGSTOP, a tracer)."""
    looks: int
    """Looks at the process's state in the window."""


def run_delay_ns(proc: Path) -> int | None:
    """Nanoseconds the process's main thread has waited on a run queue (None: gone, or no schedstats)."""
    try:
        fields = (proc / "schedstat").read_text().split()
        return int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


class SchedWatch:
    """Looks at a set of processes until `stop`, on a thread of its own; `shares` then says where their time went."""

    def __init__(self, pids: list[int], *, proc_root: Path = Path("/proc"), every_s: float = 0.01,
                 monotonic: Clock = time.monotonic) -> None:
        self.proc_root = proc_root
        self.every_s = every_s
        self.monotonic = monotonic
        self._pids = list(pids)
        self._delay0 = {p: run_delay_ns(proc_root / str(p)) for p in self._pids}
        self._t0 = monotonic()
        self._looks = dict.fromkeys(self._pids, 0)
        self._stopped = dict.fromkeys(self._pids, 0)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sched-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._halt.is_set():
            for pid in self._pids:
                st = read_stat(self.proc_root / str(pid))
                if st is None:
                    continue
                self._looks[pid] += 1
                self._stopped[pid] += st.state in STOPPED_STATES
            self._halt.wait(self.every_s)

    def stop(self) -> dict[int, SchedShares]:
        """Stop looking; each process's shares of the window (a process that is gone or unreadable is left out)."""
        self._halt.set()
        self._thread.join()
        elapsed = max(self.monotonic() - self._t0, 1e-9)
        out = {}
        for pid in self._pids:
            d0, d1 = self._delay0[pid], run_delay_ns(self.proc_root / str(pid))
            looks = self._looks[pid]
            if d0 is None or d1 is None or not looks:
                continue
            out[pid] = SchedShares(cpu_wait=min(max((d1 - d0) / 1e9 / elapsed, 0.0), 1.0),
                                   stopped=self._stopped[pid] / looks, looks=looks)
        return out
