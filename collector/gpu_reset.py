"""GPU reset carried out by the node agent: wait until the GPU is idle, reset it, read its health back.

The healer's ``reset-gpu`` plan cordons the node and drains the pods holding the GPU; the
service then queues a ``reset_gpu`` request for this node. Resetting a GPU that a process
still holds fails (and on some drivers takes the process down with it), so the handler
first waits, bounded, until NVML lists no compute or graphics process on that GPU. The
reset itself is ``nvidia-smi --gpu-reset -i <PCI bus id>`` (NVML has no public reset call);
afterwards NVML is initialised afresh and the GPU must answer, with no row-remap failure
and no pages waiting for retirement, before the request is answered ``done``.

Privileges (documented in deploy/agent/): the agent container runs privileged with the
driver's ``nvidia-smi`` (NVIDIA_DRIVER_CAPABILITIES=utility) and sees every GPU
(NVIDIA_VISIBLE_DEVICES=all): a reset needs root and all of ``/dev/nvidia*``.
"""

from __future__ import annotations

import importlib
import logging
import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from collector.node_requests import Answer, NodeRequest

log = logging.getLogger(__name__)


class ResetNvml(Protocol):
    """The NVML calls a reset needs (``pynvml`` or ``FakeNvml``). Every call may raise ``NVMLError``."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int: ...


def load_reset_nvml() -> ResetNvml:
    """The real bindings (raises ImportError where nvidia-ml-py is missing)."""
    mod: ResetNvml = importlib.import_module("pynvml")
    return mod


CommandRunner = Callable[[Sequence[str], float], tuple[int, str]]
"""Runs a command with a timeout; returns (exit code, stdout and stderr)."""


def run_command(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    """``subprocess.run`` with output captured; a missing binary or a timeout is exit code 127 / 124."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        return 127, str(exc)
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]} did not finish within {timeout:.0f} s"
    return done.returncode, (done.stdout + done.stderr).strip()


_PCI = re.compile(r"(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})(?:\.[0-7])?$")


def pci_key(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI bus id in any spelling NVML, nvidia-smi and Xid lines use:
    ``00000000:5D:00.0``, ``0000:5d:00``, ``5d:00.0``."""
    m = _PCI.search(text.strip())
    if m is None:
        return None
    return int(m.group("dom") or "0", 16), int(m.group("bus"), 16), int(m.group("dev"), 16)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """What NVML says of one GPU after a reset."""

    pci: str
    """Its PCI bus id as NVML spells it."""
    name: str
    """Product name."""
    remap_pending: bool
    """Rows wait for a reset to be remapped."""
    remap_failed: bool
    """Row remapping failed: the GPU must be replaced."""
    retirement_pending: bool
    """Pages wait for a reset to be retired."""

    @property
    def problem(self) -> str:
        """Why the GPU is not fit for work (empty when it is)."""
        if self.remap_failed:
            return "row remapping failed (replace the GPU)"
        if self.remap_pending:
            return "rows still pending remapping after the reset"
        if self.retirement_pending:
            return "pages still pending retirement after the reset"
        return ""


class GpuResetHandler:
    """``reset_gpu`` requests: idle wait, ``nvidia-smi --gpu-reset``, health read back."""

    kind = "reset_gpu"

    def __init__(self, *, load_nvml: Callable[[], ResetNvml], nvidia_smi: str = "nvidia-smi",
                 run: CommandRunner = run_command, idle_timeout_s: float = 600.0, idle_poll_s: float = 5.0,
                 reset_timeout_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.load_nvml = load_nvml
        self.nvidia_smi = nvidia_smi
        self.run_cmd = run
        self.idle_timeout_s = idle_timeout_s
        self.idle_poll_s = idle_poll_s
        self.reset_timeout_s = reset_timeout_s
        self.clock = clock

    def run(self, request: NodeRequest, stop: threading.Event) -> Answer:
        try:
            nv = self.load_nvml()
            nv.nvmlInit()
        except Exception as exc:
            return Answer("failed", f"NVML unavailable on this node: {exc}")
        try:
            found = self._find(nv, request.params)
            if isinstance(found, str):
                return Answer("failed", found)
            handle, pci = found
            deadline = self.clock() + self.idle_timeout_s
            while True:
                pids = self._holders(nv, handle)
                if not pids:
                    break
                if self.clock() >= deadline:
                    return Answer("failed", f"GPU {pci} still used by process(es) {sorted(pids)} after "
                                            f"{self.idle_timeout_s:.0f} s; not reset")
                if stop.wait(self.idle_poll_s):
                    return Answer("failed", f"{_why(stop)} while waiting for the GPU to go idle: not reset")
        finally:
            _shutdown(nv)
        if stop.is_set():  # withdrawn in the last moment of the wait: the reset is the one step that cannot be undone
            return Answer("failed", f"{_why(stop)} before the reset: not reset")
        code, out = self.run_cmd([self.nvidia_smi, "--gpu-reset", "-i", pci], self.reset_timeout_s)
        if code != 0:
            return Answer("failed", f"nvidia-smi --gpu-reset -i {pci} exited {code}: {out[-1500:]}")
        health = self._read_back(pci)
        if isinstance(health, str):
            return Answer("failed", f"GPU {pci} reset, but {health}")
        if health.problem:
            return Answer("failed", f"GPU {pci} ({health.name}) reset, but {health.problem}")
        return Answer("done", f"GPU {pci} ({health.name}) reset and healthy: {out[-300:]}".rstrip(": "))

    def resume(self, request: NodeRequest) -> Answer:
        pci = request.params.get("pci") or request.params.get("gpu", "")
        health = self._read_back(pci) if pci else "no GPU named in the request"
        if isinstance(health, str):
            return Answer("failed", f"reset interrupted by an agent restart; {health}")
        if health.problem:
            return Answer("failed", f"reset interrupted by an agent restart; GPU {pci}: {health.problem}")
        return Answer("done", f"reset interrupted by an agent restart; GPU {health.pci} ({health.name}) answers "
                              "and is healthy (not reset again)")

    def _find(self, nv: ResetNvml, params: Any) -> tuple[Any, str] | str:
        """The GPU the request names, by PCI bus id first (indices can change across resets), then index."""
        want = pci_key(params.get("pci", "")) if params.get("pci") else None
        index = params.get("gpu", "")
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pci = _text(nv.nvmlDeviceGetPciInfo(h).busId)
            if (want is not None and pci_key(pci) == want) or (want is None and index.isdigit() and int(index) == i):
                return h, pci
        named = params.get("pci") or (f"index {index}" if index else "")
        if not named:
            return "the request names no GPU (pci or gpu index)"
        return f"no GPU {named} on this node (it may have fallen off the bus: reboot or replace)"

    @staticmethod
    def _holders(nv: ResetNvml, handle: Any) -> set[int]:
        procs = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
        procs += list(nv.nvmlDeviceGetGraphicsRunningProcesses(handle))
        return {int(p.pid) for p in procs}

    def _read_back(self, pci: str) -> GpuHealth | str:
        """Fresh NVML session: a reset invalidates the old handles."""
        try:
            nv = self.load_nvml()
            nv.nvmlInit()
        except Exception as exc:
            return f"NVML does not answer after the reset: {exc}"
        try:
            found = self._find(nv, {"pci": pci} if pci_key(pci) else {"gpu": pci})
            if isinstance(found, str):
                return found
            h, bus = found
            name = _text(nv.nvmlDeviceGetName(h))
            try:
                _corr, _unc, pending, failure = nv.nvmlDeviceGetRemappedRows(h)
            except nv.NVMLError:  # pre-Ampere GPUs have no row remapping
                pending = failure = 0
            try:
                retire = nv.nvmlDeviceGetRetiredPagesPendingStatus(h)
            except nv.NVMLError:  # Ampere and later retire nothing: rows are remapped instead
                retire = 0
            return GpuHealth(bus, name, bool(pending), bool(failure), bool(retire))
        except nv.NVMLError as exc:
            return f"NVML error reading GPU {pci}: {exc}"
        finally:
            _shutdown(nv)


def _shutdown(nv: ResetNvml) -> None:
    try:
        nv.nvmlShutdown()
    except Exception as exc:  # a shutdown error must not hide the outcome
        log.debug("nvmlShutdown: %s", exc)


def _why(stop: threading.Event) -> str:
    """Why a request's run should stop (a ``Halt`` says; a plain event is the agent's own stop)."""
    return getattr(stop, "why", "") or "the agent stopped"
