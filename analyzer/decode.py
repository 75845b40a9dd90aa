"""Actions carried inside a message: Xid 154's recovery action, Xid 144-150 register decode.

Some lines say what to do about them; the rule's fixed action is only the fallback.
Pure functions over the fields a rule extracted from the matched line.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from analyzer.records import ACTION_RANK, Action, Severity


@dataclass(frozen=True, slots=True)
class ActionMap:
    """Choose the action from the value of one extracted field."""

    field: str
    """Named group whose value picks the action."""
    values: tuple[tuple[str, Action], ...]
    """Field value (compared case-insensitively, leading zeros ignored for hex) to action."""

    def action_for(self, fields: Mapping[str, str]) -> Action | None:
        """The mapped action, or None when the field is absent or its value unknown."""
        raw = fields.get(self.field)
        if raw is None:
            return None
        key = _norm(raw)
        for value, action in self.values:
            if _norm(value) == key:
                return action
        return None


def _norm(value: str) -> str:
    # Hex codes compare by value ("0x04" == "4"); other values compare as lower-case text.
    v = value.strip().lower()
    if v.startswith("0x"):
        v = v[2:]
    if v and all(c in "0123456789abcdef" for c in v):
        return v.lstrip("0") or "0"
    return v


class StatusMatch(StrEnum):
    """How a decode row's status values compare with the message's status register."""

    BITS = "bits"
    """Any of the row's status bits is set."""
    EQUALS = "equals"
    """The register equals one of the row's values (sub-codes, not bit masks)."""


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One row of a vendor decode table: register patterns to a recovery action."""

    unit: str
    """Hardware unit the row describes (e.g. ``NETIR_LINK_EVT``)."""
    intrinfo: tuple[str, ...]
    """IntrInfo bit patterns, most significant bit first, ``-`` for any bit; one per driver format."""
    status: tuple[int, ...]
    """Error-status values; empty matches any status."""
    match: StatusMatch
    """How ``status`` is compared."""
    action: Action
    """What to do when the row applies."""
    severity: Severity
    """Severity when the row applies."""
    hardware: bool | None = None
    """Whether the table blames the hardware; None keeps the rule's own call (the table says both)."""

    def applies(self, intrinfo: int, status: int | None) -> bool:
        """Whether both registers fit this row."""
        if not any(_fits(p, intrinfo) for p in self.intrinfo):
            return False
        if not self.status or status is None:
            return True
        if self.match is StatusMatch.EQUALS:
            return status in self.status
        return any(status & s for s in self.status)


def _fits(pattern: str, value: int) -> bool:
    bits = format(value, f"0{len(pattern)}b")[-len(pattern):]
    return all(p in ("-", b) for p, b in zip(pattern, bits, strict=True))


@dataclass(frozen=True, slots=True)
class Decoder:
    """Decode two hex registers from a matched line into an action and a severity."""

    intrinfo_field: str
    """Named group holding the IntrInfo register (hex)."""
    status_field: str
    """Named group holding the error-status register (hex)."""
    rows: tuple[DecodeRow, ...]
    """The decode table."""

    def decode(self, fields: Mapping[str, str]) -> DecodeRow | None:
        """The most disruptive applicable row, or None when nothing applies."""
        intrinfo = _hex(fields.get(self.intrinfo_field))
        if intrinfo is None:
            return None
        return _decode(self, intrinfo, _hex(fields.get(self.status_field)))


@functools.lru_cache(maxsize=8192)
def _decode(decoder: Decoder, intrinfo: int, status: int | None) -> DecodeRow | None:
    """Cached: a fleet prints the same few register values again and again."""
    hits = [r for r in decoder.rows if r.applies(intrinfo, status)]
    if not hits:
        return None
    return max(hits, key=lambda r: ACTION_RANK[r.action])


def _hex(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw, 16)
    except ValueError:
        return None
