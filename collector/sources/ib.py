"""InfiniBand / RoCE port state and error counters from sysfs.

``<root>/<device>/ports/<port>/{state,phys_state,rate}`` and
``counters/*`` (plus ``hw_counters/*`` where the driver has them). Counters
are cumulative; each sample carries the total and, from the second read on,
a ``_delta`` sample with the increase since the previous read (a counter that
went down was reset, so its new value is the increase).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from collector.signal import MetricSample, Signal, Source
from collector.sources.base import Clock, Poll

_LEADING_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)")


def _number(text: str) -> float | None:
    m = _LEADING_NUMBER.match(text)
    return float(m.group(1)) if m else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        # Some counters are write-only or vanish with a port reset.
        return None


class IbSysfsSource:
    """Samples every port of every RDMA device at a fixed interval."""

    name = "ib"

    def __init__(
        self,
        *,
        node: str,
        root: Path = Path("/sys/class/infiniband"),
        interval: float = 15.0,
        clock: Clock = time.time,
    ) -> None:
        self.node = node
        self.root = root
        self.interval = interval
        self.clock = clock
        self._next = 0.0
        self._last: dict[tuple[str, str, str], float] = {}

    def poll(self) -> Poll:
        """One sample of every port, or nothing before the interval is up."""
        now = self.clock()
        if now < self._next:
            return Poll()
        self._next = now + self.interval
        signals: list[Signal] = []
        try:
            devices = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return Poll()
        seen: set[tuple[str, str, str]] = set()
        for dev in devices:
            ports_dir = self.root / dev / "ports"
            try:
                ports = sorted(os.listdir(ports_dir))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for port in ports:
                pdir = ports_dir / port
                labels = {"device": dev, "port": port}
                self._port_state(pdir, labels, now, signals)
                for sub in ("counters", "hw_counters"):
                    self._counters(pdir / sub, labels, now, signals, seen)
        for key in [k for k in self._last if k not in seen]:
            del self._last[key]
        return Poll(signals, {}, len(signals))

    def _sample(self, name: str, value: float, labels: dict[str, str], now: float) -> Signal:
        ident = f"{labels['device']}/{labels['port']}/{name}/{int(now * 1000)}"
        return Signal(
            id=f"{self.node}/ib/{ident}", node=self.node, source=Source.IB, ts=now,
            payload=MetricSample(name, value, labels),
        )

    def _port_state(self, pdir: Path, labels: dict[str, str], now: float, out: list[Signal]) -> None:
        for fname in ("state", "phys_state"):
            text = _read(pdir / fname)
            if text is None:
                continue
            value = _number(text)
            if value is not None:
                # "4: ACTIVE" -> 4, with the name kept as a label for humans.
                out.append(self._sample(f"ib_port_{fname}", value,
                                        {**labels, fname: text.partition(":")[2].strip()}, now))
        rate = _read(pdir / "rate")
        value = _number(rate) if rate else None
        if value is not None:
            out.append(self._sample("ib_port_rate_gbps", value, labels, now))

    def _counters(
        self, cdir: Path, labels: dict[str, str], now: float, out: list[Signal],
        seen: set[tuple[str, str, str]],
    ) -> None:
        try:
            names = sorted(os.listdir(cdir))
        except (FileNotFoundError, NotADirectoryError):
            return
        for cname in names:
            text = _read(cdir / cname)
            value = _number(text) if text else None
            if value is None:
                continue
            key = (labels["device"], labels["port"], cname)
            seen.add(key)
            out.append(self._sample(f"ib_{cname}", value, labels, now))
            prev = self._last.get(key)
            self._last[key] = value
            if prev is not None:
                delta = value - prev if value >= prev else value
                out.append(self._sample(f"ib_{cname}_delta", delta, labels, now))

    def close(self) -> None:
        """Nothing is held open."""
