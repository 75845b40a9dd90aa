"""Multi-pattern matching: the whole rule pack compiled into one database, batches scanned at once.

A batch of lines is joined with newlines and scanned a block of lines per call (a log file's
bytes in one call); match offsets map back to lines, and only the matched lines are searched
again with the rule's own RE2 regex, which confirms the match and extracts its fields. The
database is a prefilter: the rule's RE2 regex is the single source of truth for what matches,
so every backend gives the same findings.

Backends, fastest first: hyperscan (all patterns in one DFA/NFA database), RE2's
``re2.Set`` (tells which rules match somewhere in the batch), per-rule RE2 (every rule's
regex over the joined batch). Every step is RE2 or hyperscan, both linear in the text: no
rule and no line can make a scan backtrack.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray

from analyzer.rules import LinearRegex, RegexMatch, Rule, compile_linear

_NL = ord("\n")
_BLOCK = 2048
"""Lines joined, encoded and scanned at a time: about 200 kB of log, which stays in the CPU cache."""


class Backend(StrEnum):
    """Which multi-pattern engine scans the batches."""

    HYPERSCAN = "hyperscan"
    RE2 = "re2"
    RE = "re"
    """Per-rule scan of the joined batch (with RE2 regexes: the name is kept for settings and benches)."""


@dataclass(frozen=True, slots=True)
class BufferMatch:
    """One rule confirmed on one line of a byte buffer."""

    start: int
    """Byte offset of the line in the buffer."""
    end: int
    """Byte offset just past the line (before its newline)."""
    text: str
    """The line, decoded (invalid UTF-8 replaced)."""
    rule: Rule
    """The rule that matched."""
    match: RegexMatch
    """The rule's own regex match on that line."""


@dataclass(frozen=True, slots=True)
class LineMatch:
    """One rule confirmed on one line of a batch."""

    line: int
    """Index of the line in the batch."""
    rule: Rule
    """The rule that matched."""
    match: RegexMatch
    """The rule's own regex match on that line (named groups hold the fields)."""


def available_backends() -> list[Backend]:
    """Backends importable here, fastest first."""
    out: list[Backend] = []
    try:
        import hyperscan  # noqa: F401
        out.append(Backend.HYPERSCAN)
    except ImportError:
        pass
    try:
        import re2  # noqa: F401
        out.append(Backend.RE2)
    except ImportError:
        pass
    out.append(Backend.RE)
    return out


def _hyperscan_db(rules: Sequence[Rule]) -> tuple[Any, list[int]]:
    """Compile what hyperscan accepts; return the database and indices of rules it refused."""
    import hyperscan

    flags = hyperscan.HS_FLAG_MULTILINE

    def compile_some(idx: list[int]) -> Any:
        db = hyperscan.Database()
        db.compile(
            expressions=[rules[i].pattern.encode() for i in idx], ids=idx,
            elements=len(idx), flags=[flags] * len(idx),
        )
        return db

    idx = list(range(len(rules)))
    try:
        return compile_some(idx), []
    except hyperscan.error:
        pass
    # Only on failure: find the patterns hyperscan cannot take; they go through `re` instead.
    ok: list[int] = []
    refused: list[int] = []
    for i in idx:
        try:
            compile_some([i])
            ok.append(i)
        except hyperscan.error:
            refused.append(i)
    return (compile_some(ok) if ok else None), refused


class MultiMatcher:
    """All rules of a pack in one multi-pattern database; scans whole batches of lines."""

    def __init__(self, rules: Sequence[Rule], *, backend: Backend | None = None) -> None:
        self.rules = tuple(rules)
        self.backend = backend or available_backends()[0]
        self._residual: list[int] = []
        self._hs: Any = None
        self._set: Any = None
        # Multi-line mode so ^ and $ anchor at line boundaries of the joined batch.
        self._line_re: list[LinearRegex] = [compile_linear(r.pack, r.id, r.pattern, multiline=True)
                                            for r in self.rules]
        self._order = {r.id: i for i, r in enumerate(self.rules)}
        if self.backend is Backend.HYPERSCAN:
            self._hs, self._residual = _hyperscan_db(self.rules)
        elif self.backend is Backend.RE2:
            self._set, self._residual = self._re2_set()
        else:
            self._residual = list(range(len(self.rules)))

    def _re2_set(self) -> tuple[Any, list[int]]:
        import re2

        opts = re2.Options()
        opts.log_errors = False
        rset = re2.Set.SearchSet(opts)
        refused: list[int] = []
        self._set_ids: list[int] = []
        for i, r in enumerate(self.rules):
            try:
                # Multi-line mode so ^ and $ anchor at line boundaries of the joined batch.
                rset.Add("(?m)" + r.pattern)
                self._set_ids.append(i)
            except re2.error:
                refused.append(i)
        rset.Compile()
        return rset, refused

    # -- scanning ------------------------------------------------------------

    def scan(self, lines: Sequence[str]) -> list[LineMatch]:
        """Rules confirmed on lines of one batch, ordered by line then rule load order."""
        if not lines:
            return []
        if self._hs is not None:
            candidates: set[tuple[int, int]] = set()
            # Block by block, so the joined text, its bytes and the newline mask stay in the CPU cache
            # between the passes over them. Findings are confirmed on single lines, so no match that
            # could become one spans a block boundary.
            for first in range(0, len(lines), _BLOCK):
                block = lines[first:first + _BLOCK]
                text = "\n".join(block)
                data = text.encode("ascii") if text.isascii() else text.encode("utf-8", "surrogatepass")
                newline = np.frombuffer(data, dtype=np.uint8) == _NL
                if int(np.count_nonzero(newline)) != len(block) - 1:
                    # A line with an embedded newline would shift every later line: keep lines whole.
                    return self.scan([ln.replace("\n", " ") for ln in lines])
                candidates.update((first + line, rule_no) for line, rule_no in self._hyperscan_lines(data, newline))
            if self._residual:
                candidates |= self._scan_re("\n".join(lines), self._residual, lines)
        else:
            text = "\n".join(lines)
            if text.count("\n") != len(lines) - 1:
                return self.scan([ln.replace("\n", " ") for ln in lines])
            candidates = set()
            if self._set is not None:
                matched = self._set.Match(text) or []
                candidates |= self._scan_re(text, [self._set_ids[i] for i in matched], lines)
            if self._residual:
                candidates |= self._scan_re(text, self._residual, lines)
        out: list[LineMatch] = []
        for line_no, rule_no in sorted(candidates):
            rule = self.rules[rule_no]
            m = rule.regex.search(lines[line_no])
            if m:
                out.append(LineMatch(line_no, rule, m))
        return out

    def scan_buffer(self, data: bytes) -> list[BufferMatch]:
        """Rules confirmed on the lines of a newline-separated byte buffer (a log file as read).

        Only matched lines are located and decoded, so nothing is done per line of input:
        this is the path for whole files. Offsets are bytes into ``data``.
        """
        if self._hs is None:
            return self._scan_buffer_split(data)
        hits: list[tuple[int, int]] = []

        def on_match(rule_no: int, _start: int, end: int, _flags: int, _ctx: object) -> None:
            hits.append((end, rule_no))

        self._hs.scan(data, match_event_handler=on_match)
        seen: set[tuple[int, int]] = set()
        lines: dict[int, tuple[int, str]] = {}
        for end, rule_no in sorted(hits):
            at = max(end - 1, 0)
            start = data.rfind(b"\n", 0, at) + 1
            if (start, rule_no) in seen:
                continue
            seen.add((start, rule_no))
            if start not in lines:
                stop = data.find(b"\n", start)
                stop = len(data) if stop < 0 else stop
                lines[start] = (stop, data[start:stop].decode("utf-8", "replace").rstrip("\r"))
        out: list[BufferMatch] = []
        for start, rule_no in sorted(seen):
            stop, text = lines[start]
            rule = self.rules[rule_no]
            m = rule.regex.search(text)
            if m:
                out.append(BufferMatch(start, stop, text, rule, m))
        out.extend(self._residual_buffer(data))
        out.sort(key=lambda b: (b.start, self._order[b.rule.id]))
        return out

    def _residual_buffer(self, data: bytes) -> list[BufferMatch]:
        if not self._residual:
            return []
        return self._scan_buffer_split(data, only=self._residual)

    def _scan_buffer_split(self, data: bytes, only: list[int] | None = None) -> list[BufferMatch]:
        raw = data.split(b"\n")
        texts = [r.decode("utf-8", "replace").rstrip("\r") for r in raw]
        if only is None:
            found = self.scan(texts)
        else:
            text = "\n".join(texts)
            cands = sorted(self._scan_re(text, only, texts))
            found = [LineMatch(i, self.rules[r], m) for i, r in cands
                     if (m := self.rules[r].regex.search(texts[i]))]
        offsets: list[int] = []
        pos = 0
        for r in raw:
            offsets.append(pos)
            pos += len(r) + 1
        return [
            BufferMatch(offsets[h.line], offsets[h.line] + len(raw[h.line]), texts[h.line], h.rule, h.match)
            for h in found
        ]

    def _hyperscan_lines(self, data: bytes, newline: NDArray[np.bool_]) -> set[tuple[int, int]]:
        """(line, rule) candidates; ``newline`` marks the newline bytes of ``data``."""
        hits: list[tuple[int, int]] = []

        def on_match(rule_no: int, _start: int, end: int, _flags: int, _ctx: object) -> None:
            hits.append((end, rule_no))

        self._hs.scan(data, match_event_handler=on_match)
        if not hits:
            return set()
        # A match ending right after a newline belongs to the line before it: look at its last byte.
        ends = [max(end - 1, 0) for end, _ in hits]
        # Only hit positions are resolved, so the cost is the hits, not the lines of the batch.
        line_of: dict[int, int] = {}
        line = pos = 0
        for at in sorted(set(ends)):
            line += int(np.count_nonzero(newline[pos:at]))
            line_of[at] = line
            pos = at
        return {(line_of[end], rule_no) for end, (_, rule_no) in zip(ends, hits, strict=True)}

    def _scan_re(self, text: str, rule_nos: Iterable[int], lines: Sequence[str]) -> set[tuple[int, int]]:
        starts: list[int] | None = None
        out: set[tuple[int, int]] = set()
        for rule_no in rule_nos:
            for m in self._line_re[rule_no].finditer(text):
                if starts is None:
                    starts = _line_starts(lines)
                out.add((bisect.bisect_right(starts, m.start()) - 1, rule_no))
        return out


def _line_starts(lines: Sequence[str]) -> list[int]:
    """Offset of each line in the newline-joined text (lengths summed in C, not a Python loop)."""
    if not lines:
        return []
    return list(itertools.accumulate(map(operator.add, map(len, lines[:-1]), itertools.repeat(1)), initial=0))


class NaiveMatcher:
    """Reference: every rule's regex searched on every line (the baseline the benchmark compares)."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)

    def scan(self, lines: Sequence[str]) -> list[LineMatch]:
        """Same contract as :meth:`MultiMatcher.scan`."""
        out: list[LineMatch] = []
        for i, ln in enumerate(lines):
            for rule in self.rules:
                m = rule.regex.search(ln)
                if m:
                    out.append(LineMatch(i, rule, m))
        return out
