"""GPU health through NVML (nvidia-ml-py): Xid events and health counters.

Xid events come from an NVML event set, drained without waiting on every
poll; counters are sampled at a fixed interval. A node without NVML (CPU
nodes, containers without the driver) is normal: the source says once that
it is unavailable and then yields nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from collector.signal import MetricSample, Signal, Source
from collector.sources.base import Clock, Poll

log = logging.getLogger(__name__)


class NvmlModule(Protocol):
    """The part of the ``pynvml`` module the source uses.

    Guarantees (as NVML's): every call may raise ``NVMLError``, whose ``value``
    is an ``NVML_ERROR_*`` code; ``nvmlEventSetWait`` with a 0 ms timeout
    returns at once, raising ``NVMLError`` with ``NVML_ERROR_TIMEOUT`` when no
    event is pending.
    """

    NVMLError: type[Exception]
    NVML_ERROR_TIMEOUT: int
    NVML_MEMORY_ERROR_TYPE_CORRECTED: int
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED: int
    NVML_VOLATILE_ECC: int
    NVML_AGGREGATE_ECC: int
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: int
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: int
    NVML_TEMPERATURE_GPU: int
    NVML_CLOCK_SM: int
    NVML_NVLINK_MAX_LINKS: int
    NVML_NVLINK_ERROR_DL_REPLAY: int
    NVML_NVLINK_ERROR_DL_RECOVERY: int
    NVML_NVLINK_ERROR_DL_CRC_FLIT: int
    NVML_NVLINK_ERROR_DL_CRC_DATA: int
    nvmlEventTypeXidCriticalError: int

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int: ...
    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int: ...
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any: ...


def load_pynvml() -> NvmlModule:
    """The real bindings (raises ImportError where nvidia-ml-py is missing)."""
    mod: NvmlModule = importlib.import_module("pynvml")
    return mod


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Gpu:
    def __init__(self, index: int, handle: Any, uuid: str, pci: str) -> None:
        self.index = index
        self.handle = handle
        self.labels = {"gpu": str(index), "uuid": uuid, "pci": pci}


class NvmlSource:
    """Xid events and health counters of every GPU on the node."""

    name = "nvml"

    def __init__(
        self,
        *,
        node: str,
        load: Callable[[], NvmlModule] = load_pynvml,
        interval: float = 15.0,
        clock: Clock = time.time,
    ) -> None:
        self.node = node
        self.interval = interval
        self.clock = clock
        self.available = False
        self.reason = ""
        """Why NVML is unavailable (empty when it is available)."""
        self._nv: NvmlModule | None = None
        self._gpus: list[_Gpu] = []
        self._events: Any = None
        self._next = 0.0
        self._seq = 0
        self._unsupported: set[tuple[int, str]] = set()
        try:
            nv = load()
            nv.nvmlInit()
            self._gpus = self._enumerate(nv)
            self._events = self._register(nv)
            self._nv = nv
            self.available = True
        except Exception as exc:
            self.reason = f"{type(exc).__name__}: {exc}"
            log.info("NVML unavailable, GPU metrics from NVML disabled: %s", self.reason)

    def _enumerate(self, nv: NvmlModule) -> list[_Gpu]:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pci = _text(nv.nvmlDeviceGetPciInfo(h).busId)
            gpus.append(_Gpu(i, h, _text(nv.nvmlDeviceGetUUID(h)), pci))
        return gpus

    def _register(self, nv: NvmlModule) -> Any:
        try:
            events = nv.nvmlEventSetCreate()
            for g in self._gpus:
                nv.nvmlDeviceRegisterEvents(g.handle, nv.nvmlEventTypeXidCriticalError, events)
        except nv.NVMLError as exc:
            # Counters still work where events are not supported (some vGPU setups).
            log.info("NVML Xid events unavailable: %s", exc)
            return None
        return events

    def _signal(self, name: str, value: float, labels: dict[str, str], now: float) -> Signal:
        self._seq += 1
        return Signal(
            id=f"{self.node}/nvml/{labels.get('uuid', '-')}/{name}/{int(now * 1000)}/{self._seq}",
            node=self.node, source=Source.NVML, ts=now, payload=MetricSample(name, value, labels),
        )

    def poll(self) -> Poll:
        """Pending Xid events, and the counters once per interval."""
        nv = self._nv
        if nv is None:
            return Poll()
        now = self.clock()
        out: list[Signal] = []
        if self._events is not None:
            by_uuid = {g.labels["uuid"]: g for g in self._gpus}
            while True:
                try:
                    ev = nv.nvmlEventSetWait(self._events, 0)
                except nv.NVMLError as exc:
                    if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                        raise
                    break
                # Handles are ctypes pointers: match the event's device by UUID.
                gpu = by_uuid.get(_text(nv.nvmlDeviceGetUUID(ev.device)))
                labels = dict(gpu.labels) if gpu else {}
                out.append(self._signal("nvml_xid", float(ev.eventData), labels, now))
        if now >= self._next:
            self._next = now + self.interval
            for g in self._gpus:
                out.extend(self._counters(nv, g, now))
        return Poll(out, {}, len(out))

    def _read(self, nv: NvmlModule, g: _Gpu, what: str, fn: Callable[[], Any]) -> Any:
        if (g.index, what) in self._unsupported:
            return None
        try:
            return fn()
        except nv.NVMLError:
            # Not supported on this GPU model or driver: stop asking.
            self._unsupported.add((g.index, what))
            return None

    def _counters(self, nv: NvmlModule, g: _Gpu, now: float) -> list[Signal]:
        h = g.handle
        vals: dict[str, float] = {}
        ecc = (
            ("ecc_corrected_volatile", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_uncorrected_volatile", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_corrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_uncorrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        )
        for name, etype, ctype in ecc:
            v = self._read(nv, g, name, partial(nv.nvmlDeviceGetTotalEccErrors, h, etype, ctype))
            if v is not None:
                vals[name] = v
        for name, cause in (
            ("retired_pages_sbe", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            ("retired_pages_dbe", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
        ):
            pages = self._read(nv, g, name, partial(nv.nvmlDeviceGetRetiredPages, h, cause))
            if pages is not None:
                vals[name] = len(pages)
        pending = self._read(nv, g, "retired_pages_pending",
                             lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
        if pending is not None:
            vals["retired_pages_pending"] = pending
        rows = self._read(nv, g, "remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, is_pending, failed = rows
            vals.update(remapped_rows_correctable=corr, remapped_rows_uncorrectable=unc,
                        remapped_rows_pending=is_pending, remapped_rows_failure=failed)
        simple: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("clocks_throttle_reasons", lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
            ("temperature_celsius", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            # The straggler detector compares SM clocks across nodes (a throttled GPU runs slow).
            ("clocks_sm_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            ("power_watts", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("pcie_replay_total", lambda: nv.nvmlDeviceGetPcieReplayCounter(h)),
        )
        for name, fn in simple:
            v = self._read(nv, g, name, fn)
            if v is not None:
                vals[name] = v
        util = self._read(nv, g, "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            vals["utilization_gpu_percent"] = util.gpu
            vals["utilization_memory_percent"] = util.memory
        out = [self._signal(f"nvml_{k}", float(v), g.labels, now) for k, v in vals.items()]
        out.extend(self._nvlink(nv, g, now))
        return out

    def _nvlink(self, nv: NvmlModule, g: _Gpu, now: float) -> list[Signal]:
        out: list[Signal] = []
        counters = (
            ("replay", nv.NVML_NVLINK_ERROR_DL_REPLAY),
            ("recovery", nv.NVML_NVLINK_ERROR_DL_RECOVERY),
            ("crc_flit", nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            ("crc_data", nv.NVML_NVLINK_ERROR_DL_CRC_DATA),
        )
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            state = self._read(nv, g, f"nvlink{link}",
                               partial(nv.nvmlDeviceGetNvLinkState, g.handle, link))
            if not state:
                continue
            labels = {**g.labels, "link": str(link)}
            for cname, ctr in counters:
                v = self._read(nv, g, f"nvlink{link}_{cname}",
                               partial(nv.nvmlDeviceGetNvLinkErrorCounter, g.handle, link, ctr))
                if v is not None:
                    out.append(self._signal(f"nvml_nvlink_{cname}_errors_total", float(v), labels, now))
        return out

    def close(self) -> None:
        """Shut NVML down if it was started."""
        if self._nv is not None:
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlShutdown()
            self._nv = None
