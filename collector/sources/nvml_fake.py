"""An in-memory NVML (the ``NvmlModule`` protocol) for nodes and tests without GPUs."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


class FakeNVMLError(Exception):
    """NVML error with its ``NVML_ERROR_*`` code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    """State of one fake GPU; fields left ``None`` are "not supported"."""

    uuid: str
    """GPU UUID."""
    pci: str
    """PCI bus id, e.g. ``00000000:07:00.0``."""
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    """(error type, counter type) to count."""
    retired: dict[int, list[int]] = field(default_factory=dict)
    """Retirement cause to page addresses."""
    retired_pending: int = 0
    """Pages waiting for a reboot to be retired."""
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    """(correctable, uncorrectable, pending, failure)."""
    throttle: int = 0
    """Clock throttle reason bitmask."""
    temperature: int = 40
    """Degrees Celsius."""
    power_mw: int = 100000
    """Power draw in milliwatts."""
    pcie_replay: int = 0
    """PCIe replay counter."""
    nvlinks: dict[int, dict[int, int]] = field(default_factory=dict)
    """Active link to (error counter to value)."""
    utilization: tuple[int, int] = (0, 0)
    """(gpu, memory) percent."""
    sm_clock_mhz: int | None = 1980
    """Current SM clock; ``None``: not supported."""
    name: str = "NVIDIA H100 80GB HBM3"
    """Product name."""
    processes: list[int] = field(default_factory=list)
    """PIDs of compute processes holding the GPU."""


@dataclass
class _Pci:
    busId: str


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int = 0


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Event:
    device: Any
    eventType: int
    eventData: int


class FakeNvml:
    """Implements the ``NvmlModule`` protocol over ``FakeGpu`` records."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_ERROR_DL_REPLAY = 0
    NVML_NVLINK_ERROR_DL_RECOVERY = 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_NVLINK_ERROR_DL_CRC_DATA = 3
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.initialized = False
        self._events: deque[_Event] = deque()

    def inject_xid(self, index: int, xid: int) -> None:
        """Queue an Xid critical-error event on GPU ``index``."""
        self._events.append(_Event(self.gpus[index], self.nvmlEventTypeXidCriticalError, xid))

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return str(handle.uuid)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return _Pci(handle.pci)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        return int(handle.ecc.get((error_type, counter_type), 0))

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]:
        return list(handle.retired.get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return int(handle.retired_pending)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        if handle.remapped_rows is None:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        rows: tuple[int, int, int, int] = handle.remapped_rows
        return rows

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return int(handle.throttle)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return int(handle.temperature)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(handle.power_mw)

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return int(handle.pcie_replay)

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return 1 if link in handle.nvlinks else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        return int(handle.nvlinks.get(link, {}).get(counter, 0))

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        if clock_type != self.NVML_CLOCK_SM or handle.sm_clock_mhz is None:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return int(handle.sm_clock_mhz)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return _Util(*handle.utilization)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return str(handle.name)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return [_Process(pid) for pid in handle.processes]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return []

    def nvmlEventSetCreate(self) -> Any:
        return self._events

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        return None

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        if not self._events:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT)
        return self._events.popleft()
