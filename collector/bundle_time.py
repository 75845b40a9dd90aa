"""Years for stamps that carry none (syslog ``Dec  2 11:38:47``, glog ``E1202 11:48:48``) in an offline bundle.

``collector.timestamps`` places such stamps in ``REFERENCE_YEAR``; a bundle that also holds dated lines (CRI
and journald stamps, ISO application logs) or a file's modification time says which year they were written in.
Pure: the caller passes the anchor (the bundle's latest dated time, else the file's mtime).
"""

from __future__ import annotations

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
