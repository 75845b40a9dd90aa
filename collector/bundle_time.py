"""Years for stamps that carry none (syslog ``Dec  2 11:38:47``, glog ``E1202 11:48:48``) in an offline bundle,
and the boot time that puts dmesg's seconds-since-boot stamps on the wall clock.

``collector.timestamps`` places such stamps in ``REFERENCE_YEAR``; a bundle that also holds dated lines (CRI
and journald stamps, ISO application logs) or a file's modification time says which year they were written in.
Pure: the caller passes the anchor (the bundle's latest dated time, else the file's mtime).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC, datetime

from collector.timestamps import REFERENCE_YEAR

SLACK_S = 86400.0
"""How far past its anchor a yearless line may fall (time zones, a clock a little ahead, a file written on)."""


def is_yearless(ts: float) -> bool:
    """Whether ``ts`` came from a stamp without a year (it lies in the reference year)."""
    return datetime.fromtimestamp(ts, UTC).year == REFERENCE_YEAR


def is_dated(ts: float) -> bool:
    """Whether ``ts`` is a wall-clock time with its own year (not boot-relative, not yearless)."""
    year = datetime.fromtimestamp(ts, UTC).year
    return year > REFERENCE_YEAR


def place_year(ts: float, anchor: float) -> float:
    """The yearless time ``ts`` moved into the latest year that puts it no later than ``anchor`` + a day:
    logs are written before the bundle's last dated line and before their file was last modified."""
    t = datetime.fromtimestamp(ts, UTC)
    limit = anchor + SLACK_S
    year = datetime.fromtimestamp(anchor, UTC).year + 1
    for y in range(year, year - 5, -1):
        try:
            moved = t.replace(year=y).timestamp()
        except ValueError:  # 29 February in a year that has none
            continue
        if moved <= limit:
            return moved
    return ts


_UPTIME = re.compile(r"^(?:[^\[\n]*?\bkernel: |\s*(?:<\d{1,3}>)?)\[\s*(\d+\.\d+)\]")
# /proc/stat's boot time, as a bundle collector (sosreport, must-gather) copies the file.
_BTIME = re.compile(r"^btime (\d{9,11})$", re.M)
SAME_EVENT_S = 2.0
"""How far apart the copies of one kernel message in two files of a bundle may be stamped (syslog stamps
have whole seconds; a boot time taken from one of them carries that second's error)."""


def kernel_uptime(line: str) -> float | None:
    """The kernel's own seconds-since-boot stamp of a kernel line, as dmesg prints it or syslog keeps it
    (``Dec  2 11:38:47 worker4 kernel: [  219.470994] ...``), else None."""
    m = _UPTIME.match(line)
    return float(m.group(1)) if m else None


def boot_time_of_stat(text: str) -> float | None:
    """Boot time (epoch seconds) from a copy of ``/proc/stat``, else None."""
    m = _BTIME.search(text)
    return float(m.group(1)) if m else None


def boot_time(pairs: Iterable[tuple[float, float]]) -> float | None:
    """The boot time that lines carrying both a wall-clock and an uptime stamp give: the latest boot (the
    one a dmesg of the bundle was taken in), each pair being (wall-clock time, seconds since boot)."""
    boots = [wall - up for wall, up in pairs]
    return max(boots) if boots else None
