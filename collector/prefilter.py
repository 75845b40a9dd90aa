"""Node-side prefilter: ship only lines some rule could match.

The agent hands it the rule packs' patterns as plain strings (the collector
does not import the analyzer). Hyperscan scans a whole read buffer in one call,
so lines that match nothing cost no Python work at all; without Hyperscan the
patterns are combined into one RE2 alternation and checked line by line. Both engines
run in time linear in the line, whatever the patterns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import re2

# A leading anchor refers to the message start, which the raw buffer (with its
# CRI or syslog prefix) does not have; dropping it only widens the candidates.
_LEADING_ANCHOR = re.compile(r"^\^|(?<=\|)\^")
# Several packs name the same group (pci, xid): one alternation cannot hold both names.
_NAMED_GROUP = re.compile(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>")


def _unanchor(pattern: str) -> str:
    return _NAMED_GROUP.sub("(?:", _LEADING_ANCHOR.sub("", pattern))


def _hyperscan() -> Any | None:
    try:
        import hyperscan
    except ImportError:
        return None
    return hyperscan


class RegexPrefilter:
    """Candidate-line filter over a list of regular expressions."""

    def __init__(self, patterns: Sequence[str], *, use_hyperscan: bool = True) -> None:
        self.patterns = tuple(_unanchor(p) for p in patterns)
        opts = re2.Options()
        opts.log_errors = False
        # RE2, not `re`: a rule pattern such as (a+)+b must not make one line cost seconds on the node.
        self._combined: Any = re2.compile("|".join(f"(?:{p})" for p in self.patterns), options=opts) \
            if self.patterns else None
        self._db: Any | None = None
        self._hs: Any | None = _hyperscan() if use_hyperscan and self.patterns else None
        if self._hs is not None:
            hs = self._hs
            db = hs.Database()
            try:
                db.compile(
                    expressions=[p.encode() for p in self.patterns],
                    ids=list(range(len(self.patterns))),
                    elements=len(self.patterns),
                    flags=[hs.HS_FLAG_MULTILINE | hs.HS_FLAG_ALLOWEMPTY] * len(self.patterns),
                )
                self._db = db
            except hs.error:
                # A pattern Hyperscan cannot take: the re path is slower but exact.
                self._db = None

    @property
    def engine(self) -> str:
        """``hyperscan``, or ``re`` (the RE2 alternation line by line): which engine scans buffers."""
        return "hyperscan" if self._db is not None else "re"

    def matches(self, text: str) -> bool:
        """Whether one line is a candidate."""
        return self._combined is not None and self._combined.search(text) is not None

    def scan(self, buf: bytes) -> list[int]:
        """Sorted end offsets of matches in a buffer of newline-separated lines."""
        if not self.patterns:
            return []
        if self._db is None:
            ends: list[int] = []
            pos = 0
            for line in buf.split(b"\n"):
                if self._combined.search(line.decode("utf-8", "replace")):
                    ends.append(pos + len(line))
                pos += len(line) + 1
            return ends
        found: list[int] = []

        def on_match(_id: int, _start: int, end: int, _flags: int, _ctx: object) -> None:
            found.append(end)

        self._db.scan(buf, match_event_handler=on_match)
        found.sort()
        return found
