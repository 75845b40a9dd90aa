"""Timestamps at the start of log lines, in the formats GPU nodes and trainers write.

Pure functions: the caller decides what to do with a line that has none (line order).
Formats without a year (syslog, glog) are placed in a fixed reference year so that
lines of one bundle still order and subtract correctly; only differences matter.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from dateutil import parser as dateparser

REFERENCE_YEAR = 2000
"""Year given to stamps that carry none (syslog ``Sep 19 10:30:06``, glog ``E0321 02:07:08``)."""

_REFERENCE = datetime(REFERENCE_YEAR, 1, 1, tzinfo=UTC)

# 2024-05-11T14:10:52.224071234Z / 2024-05-11 14:10:52,224 / 2024-01-25T10:34:54,859532+00:00
_ISO = re.compile(
    r"^\s*(?:[a-z]+\s*:[a-z]+\s*: )?(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})"
    r"(?:[.,](\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?"
)
# dmesg -T: [Fri Aug 30 11:43:09 2024]; dmesg -H: [Nov23 07:03]
_DMESG_T = re.compile(r"^\s*\[(\w{3} \w{3} +\d{1,2} \d{2}:\d{2}:\d{2} \d{4}|\w{3}\d{1,2} \d\d:\d\d)\]")
# syslog: Sep 19 10:30:06 host kernel: ...
_SYSLOG = re.compile(r"^\s*(?:<\d{1,3}>)?(\w{3} +\d{1,2} \d{2}:\d{2}:\d{2}(?:\.\d{1,6})?) ")
# RFC 5424 header before its ISO stamp: <4>1 2026-11-23T07:03:12.123Z host ...
_RFC5424 = re.compile(r"^<\d{1,3}>1 ")
# /dev/kmsg record: priority,sequence,microseconds since boot,flags;message
_KMSG = re.compile(r"^\d{1,3},\d+,(\d+),[^;\s]*;")
# dmesg: [  123.456789] seconds since boot (also "<4>[ 123.45]" kmsg with priority)
_DMESG = re.compile(r"^\s*(?:<\d>|[a-z]+\s*:[a-z]+\s*: )?\[\s*(\d+\.\d+)\]")
# glog / PyTorch c10: [rank0]:[E321 02:07:08.408271257 ...] or E0321 02:07:08.408 or [E1206 18:44:12.715 ...]
_GLOG = re.compile(r"^\s*(?:\[rank\d+\]:)?\[?[IWEF](\d{1,2})(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")


def _epoch(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: str | None) -> float | None:
    try:
        t = datetime(y, mo, d, h, mi, s, tzinfo=UTC).timestamp()
    except ValueError:
        return None
    return t + (float("0." + frac) if frac else 0.0)


def _dateutil(stamp: str) -> float | None:
    """Epoch seconds of a month-name stamp; a stamp without a year lands in the reference year."""
    try:
        return dateparser.parse(stamp, default=_REFERENCE).timestamp()
    except (ValueError, OverflowError):
        return None


def parse_timestamp(line: str) -> tuple[float, str] | None:
    """``(seconds, kind)`` from the line's leading stamp, or None.

    ``kind`` is ``"epoch"`` for wall-clock stamps and ``"boot"`` for dmesg's seconds
    since boot, which cannot be compared with wall-clock ones.
    """
    if (r := _RFC5424.match(line)) is not None:
        line = line[r.end():]
    m = _ISO.match(line)
    if m:
        y, mo, d, h, mi, sec = (int(g) for g in m.groups()[:6])
        t = _epoch(y, mo, d, h, mi, sec, m.group(7))
        if t is not None:
            tz = m.group(8)
            if tz and tz != "Z":
                sign = -1 if tz[0] == "+" else 1
                hh, mm = int(tz[1:3]), int(tz[-2:])
                t += sign * (hh * 3600 + mm * 60)
            return t, "epoch"
    m = _DMESG_T.match(line) or _SYSLOG.match(line)
    if m:
        t = _dateutil(m.group(1))
        return (t, "epoch") if t is not None else None
    m = _DMESG.match(line)
    if m:
        return float(m.group(1)), "boot"
    m = _KMSG.match(line)
    if m:
        return int(m.group(1)) / 1e6, "boot"
    m = _GLOG.match(line)
    if m:
        t = _epoch(REFERENCE_YEAR, int(m.group(1)), int(m.group(2)), int(m.group(3)),
                   int(m.group(4)), int(m.group(5)), m.group(6))
        return (t, "epoch") if t is not None else None
    return None
