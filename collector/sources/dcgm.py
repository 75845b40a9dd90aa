"""GPU health from a DCGM exporter scrape (Prometheus text format).

Parsed with prometheus-client's own text parser. Only the health fields are
kept (Xid, ECC, row remap, PCIe replay, NVLink CRC, clock event reasons,
temperatures, power) plus GPU utilisation and SM clock, which the service's
hang detector (busy GPUs with no progress) and node-straggler detector (a low
SM clock) read; the other utilisation series stay with Prometheus.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable

import httpx

from collector.exposition import exposition_samples, gpu_labels
from collector.signal import MetricSample, Signal, Source
from collector.sources.base import Clock, Poll

HEALTH_FIELDS: tuple[str, ...] = (
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_RETIRED_SBE",
    "DCGM_FI_DEV_RETIRED_DBE",
    "DCGM_FI_DEV_RETIRED_PENDING",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    "DCGM_FI_DEV_THERMAL_VIOLATION",
    "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_EXP_XID_ERRORS_COUNT",
    "DCGM_EXP_XID_ERRORS_TOTAL",
    "DCGM_EXP_GPU_HEALTH_STATUS",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_SM_CLOCK",
)


def parse_scrape(text: str, keep: Iterable[str] = HEALTH_FIELDS) -> list[MetricSample]:
    """Samples of the kept fields, with ``gpu``/``uuid``/``pci`` labels normalised."""
    wanted = set(keep)
    return [MetricSample(s.name, s.value, gpu_labels(s.labels)) for s in exposition_samples(text) if s.name in wanted]


def _series(sample: MetricSample) -> str:
    key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def http_fetcher(url: str, *, timeout: float = 2.0) -> Callable[[], str]:
    """A fetch function for the exporter's ``/metrics``."""
    client = httpx.Client(timeout=timeout)

    def fetch() -> str:
        resp = client.get(url)
        resp.raise_for_status()
        return resp.text

    return fetch


class DcgmSource:
    """Scrapes the node's DCGM exporter at a fixed interval."""

    name = "dcgm"

    def __init__(
        self,
        *,
        node: str,
        fetch: Callable[[], str],
        interval: float = 15.0,
        keep: Iterable[str] = HEALTH_FIELDS,
        clock: Clock = time.time,
    ) -> None:
        self.node = node
        self.fetch = fetch
        self.interval = interval
        self.keep = tuple(keep)
        self.clock = clock
        self._next = 0.0

    def poll(self) -> Poll:
        """One scrape's health samples, or nothing before the interval is up."""
        now = self.clock()
        if now < self._next:
            return Poll()
        # Set before fetching: a failing exporter is retried at the interval, not every loop.
        self._next = now + self.interval
        samples = parse_scrape(self.fetch(), self.keep)
        stamp = int(now * 1000)
        signals = [
            Signal(id=f"{self.node}/dcgm/{_series(s)}/{stamp}", node=self.node,
                   source=Source.DCGM, ts=now, payload=s)
            for s in samples
        ]
        return Poll(signals, {}, len(samples))

    def close(self) -> None:
        """Nothing is held open."""
