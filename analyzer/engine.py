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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from analyzer.confirm import Confirmer
from analyzer.exact import hyperscan_pattern
from analyzer.rules import LinearRegex, Rule, compile_linear

_NL = ord("\n")
_BLOCK = 1024
"""Lines joined, encoded and scanned at a time: about 100 kB of log, which stays in the CPU cache."""


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
    groups: Mapping[str, str]
    """The rule's named groups that took part in the match (the fields it extracts)."""


@dataclass(frozen=True, slots=True)
class LineMatch:
    """One rule confirmed on one line of a batch."""

    line: int
    """Index of the line in the batch."""
    rule: Rule
    """The rule that matched."""
    groups: Mapping[str, str]
    """The rule's named groups that took part in the match (the fields it extracts)."""


_FIRST_TWO = operator.itemgetter(0, 1)


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
            expressions=[hyperscan_pattern(rules[i].pattern).encode() for i in idx], ids=idx,
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
        self._confirm = [Confirmer(r) for r in self.rules]
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
        opts.never_nl = True  # a match never runs over the newline between two lines of the batch
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
        """Rules confirmed on lines of one batch, ordered by line then rule load order.

        A line that holds a newline is matched as a whole, as :class:`NaiveMatcher` reads it (every
        rule's regex searched on the line); the other lines of its batch are scanned together.
        """
        if not lines:
            return []
        if self._hs is not None:
            found = self._scan_hyperscan(lines)
            if found is None:
                return self._scan_held(lines)
            if not self._residual:
                return found
            candidates = self._scan_re("\n".join(lines), self._residual, lines)
            out = found + self._confirmed(lines, candidates)
            out.sort(key=lambda m: (m.line, self._order[m.rule.id]))
            return out
        text = "\n".join(lines)
        if text.count("\n") != len(lines) - 1:
            return self._scan_held(lines)
        candidates = set()
        if self._set is not None:
            matched = self._set.Match(text) or []
            candidates |= self._scan_re(text, [self._set_ids[i] for i in matched], lines)
        if self._residual:
            candidates |= self._scan_re(text, self._residual, lines)
        return self._confirmed(lines, candidates)

    def _scan_held(self, lines: Sequence[str]) -> list[LineMatch]:
        """A batch some of whose lines hold a newline: those are matched one by one, the rest together.

        A held line stands in its batch as an empty line, so the others keep their numbers. Its
        candidates come from a scan of it alone (hyperscan reads the line's ends in multi-line mode
        as it reads them between newlines, so it finds no less than in the batch); with another
        backend every rule is a candidate. Each is confirmed by the rule's regex on the whole line.
        """
        held = [i for i, ln in enumerate(lines) if "\n" in ln]
        out = self.scan(["" if "\n" in ln else ln for ln in lines])
        every = range(len(self.rules))
        for i in held:
            text = lines[i]
            rule_nos: Iterable[int] = every
            if self._hs is not None:
                hits: list[tuple[int, int]] = []
                self._hs.scan(text.encode("utf-8", "surrogatepass"), match_event_handler=_collect, context=hits)
                rule_nos = sorted({r for _, r in hits}.union(self._residual))
            for rule_no in rule_nos:
                groups = self._confirm[rule_no].text(text)
                if groups is not None:
                    out.append(LineMatch(i, self.rules[rule_no], groups))
        out.sort(key=lambda m: (m.line, self._order[m.rule.id]))
        return out

    def _confirmed(self, lines: Sequence[str], candidates: Iterable[tuple[int, int]]) -> list[LineMatch]:
        out: list[LineMatch] = []
        for line_no, rule_no in sorted(candidates):
            groups = self._confirm[rule_no].text(lines[line_no])
            if groups is not None:
                out.append(LineMatch(line_no, self.rules[rule_no], groups))
        return out

    def _scan_hyperscan(self, lines: Sequence[str]) -> list[LineMatch] | None:
        """Confirmed matches from one hyperscan scan per block; None when a block with a hit has a newline in a line."""
        found: list[tuple[int, int, dict[str, str]]] = []
        hits: list[tuple[int, int]] = []
        # Block by block, so the joined text, its bytes and the newline mask stay in the CPU cache
        # between the passes over them. Findings are confirmed on single lines, so no match that
        # could become one spans a block boundary.
        for first in range(0, len(lines), _BLOCK):
            # A batch of one block (the agent ships 1,000 lines) is joined as it is, without a copy.
            block = lines if len(lines) <= _BLOCK else lines[first:first + _BLOCK]
            text = "\n".join(block)
            ascii_only = text.isascii()  # O(1): CPython keeps the flag on the string
            data = text.encode("ascii") if ascii_only else text.encode("utf-8", "surrogatepass")
            if not self._scan_block(data, len(block), first, None if ascii_only else block, hits, found,
                                    ascii_lines=block if ascii_only else None):
                return None
        return self._line_matches(found)

    def scan_lines(self, data: bytes, count: int) -> list[LineMatch] | None:
        """Rules confirmed on a batch of ``count`` lines received as one buffer: the lines joined by newlines.

        The bytes-in path for ingest: the buffer is scanned as it is, with no list of lines and no
        Python step for a line that matches nothing; only the lines a hit points at are located
        (from the newline offsets) and decoded. Line numbers index the batch. None when the buffer
        has a hit and does not hold exactly ``count`` lines (a line held a newline): the caller scans the list.
        A buffer without a hit has no match on any of its lines, however they are cut.
        """
        if count <= 0:
            return []
        if self._hs is None or self._residual:
            texts = data.decode("utf-8", "replace").split("\n")
            return self.scan(texts) if len(texts) == count else None
        found: list[tuple[int, int, dict[str, str]]] = []
        if not self._scan_block(data, count, 0, None, [], found):
            return None
        return self._line_matches(found)

    def _line_matches(self, found: list[tuple[int, int, dict[str, str]]]) -> list[LineMatch]:
        found.sort(key=_FIRST_TWO)
        rules = self.rules
        return [LineMatch(line, rules[rule_no], groups) for line, rule_no, groups in found]

    def _scan_block(self, data: bytes, count: int, first: int, texts: Sequence[str] | None,
                    hits: list[tuple[int, int]], found: list[tuple[int, int, dict[str, str]]], *,
                    ascii_lines: Sequence[str] | None = None) -> bool:
        """Scan one buffer of ``count`` lines; confirmed (line, rule, groups) go to ``found``.

        ``texts``: the block's lines as text, for a block that is not all ASCII; None to confirm each
        hit line on its bytes when it is ASCII, else on its decoded text. ``ascii_lines``: the lines the
        buffer joins when they are all ASCII (a hit line is then found among them, see ``_by_text``).
        False when the buffer has a hit and holds another number of lines than ``count`` (the newlines
        are counted only then).
        """
        hits.clear()
        self._hs.scan(data, match_event_handler=_collect, context=hits)
        if not hits:
            # Nothing to map to lines. A line holding a newline would have no hit alone either: the
            # buffer holds it whole, between newlines, where ^, $ and \b read as at its ends.
            return True
        hits.sort()
        if ascii_lines is not None:
            mark = len(found)
            if self._by_text(data, ascii_lines, first, hits, found):
                return True
            del found[mark:]  # a hit line is not one of the lines as given (one held a newline): count them
        newline = np.frombuffer(data, dtype=np.uint8) == _NL
        if int(np.count_nonzero(newline)) != count - 1:
            return False
        confirm = self._confirm
        # Only hit positions are resolved (newlines counted between consecutive hits), so the cost
        # is the hits, not the lines of the block; a line is confirmed once per rule that hit it.
        line = pos = 0
        for start, stop, rules in _hit_lines(data, hits):
            line += int(np.count_nonzero(newline[pos:start]))
            pos = start
            line_bytes = data[start:stop]
            for rule_no in rules:
                if texts is not None:
                    groups = confirm[rule_no].text(texts[line])
                elif line_bytes.isascii():
                    groups = confirm[rule_no].ascii(line_bytes, hit=True)
                else:
                    groups = confirm[rule_no].text(line_bytes.decode("utf-8", "replace"))
                if groups is not None:
                    found.append((first + line, rule_no, groups))
        return True

    def _by_text(self, data: bytes, lines: Sequence[str], first: int, hits: list[tuple[int, int]],
                 found: list[tuple[int, int, dict[str, str]]]) -> bool:
        """Confirm the sorted ``hits`` of an ASCII buffer that joins ``lines``, each hit line found among them.

        A hit line's index is where its text next occurs in ``lines`` (a search in C), and it is taken only
        when the lengths of the lines before it put it at the hit line's offset: that line then is the hit
        line, exactly. Nothing is done for the lines between hits but summing their lengths in C, where
        counting newlines reads and compares every byte of the buffer. False, with some matches in
        ``found`` (the caller drops them), when a hit line is not a line as given: one held a newline.
        """
        confirm = self._confirm
        line = off = 0  # a line of the batch and the offset its text starts at in the buffer
        after = 0  # where the next hit line's text is looked for (lines repeat: past the last hit line)
        for start, stop, rules in _hit_lines(data, hits):
            line_bytes = data[start:stop]
            try:
                nxt = lines.index(line_bytes.decode("ascii"), after)
            except ValueError:
                return False
            off += sum(map(len, lines[line:nxt])) + nxt - line
            if off != start:
                return False
            line, after = nxt, nxt + 1
            for rule_no in rules:
                groups = confirm[rule_no].ascii(line_bytes, hit=True)
                if groups is not None:
                    found.append((first + line, rule_no, groups))
        return True

    def scan_buffer(self, data: bytes) -> list[BufferMatch]:
        """Rules confirmed on the lines of a newline-separated byte buffer (a log file as read).

        Only matched lines are located and decoded, so nothing is done per line of input:
        this is the path for whole files. Offsets are bytes into ``data``.
        """
        if self._hs is None:
            return self._scan_buffer_split(data)
        hits: list[tuple[int, int]] = []
        self._hs.scan(data, match_event_handler=_collect, context=hits)
        hits.sort()
        found: list[tuple[int, int, int, str, dict[str, str]]] = []
        confirm = self._confirm
        for start, stop, rules in _hit_lines(data, hits):
            raw = data[start:stop].rstrip(b"\r")
            whole = len(raw) == stop - start
            text = ""
            for rule_no in rules:
                if raw.isascii():
                    groups = confirm[rule_no].ascii(raw, hit=whole)
                    if groups is not None and not text:
                        text = raw.decode("ascii")
                else:
                    text = text or raw.decode("utf-8", "replace")
                    groups = confirm[rule_no].text(text)
                if groups is not None:
                    found.append((start, rule_no, stop, text, groups))
        found.sort(key=_FIRST_TWO)
        out = [BufferMatch(start, stop, text, self.rules[rule_no], groups)
               for start, rule_no, stop, text, groups in found]
        if self._residual:
            out.extend(self._scan_buffer_split(data, only=self._residual))
            out.sort(key=lambda b: (b.start, self._order[b.rule.id]))
        return out

    def _scan_buffer_split(self, data: bytes, only: list[int] | None = None) -> list[BufferMatch]:
        raw = data.split(b"\n")
        texts = [r.decode("utf-8", "replace").rstrip("\r") for r in raw]
        if only is None:
            found = self.scan(texts)
        else:
            found = self._confirmed(texts, self._scan_re("\n".join(texts), only, texts))
        offsets: list[int] = []
        pos = 0
        for r in raw:
            offsets.append(pos)
            pos += len(r) + 1
        return [
            BufferMatch(offsets[h.line], offsets[h.line] + len(raw[h.line]), texts[h.line], h.rule, h.groups)
            for h in found
        ]

    def _scan_re(self, text: str, rule_nos: Iterable[int], lines: Sequence[str]) -> set[tuple[int, int]]:
        starts: list[int] | None = None
        out: set[tuple[int, int]] = set()
        for rule_no in rule_nos:
            for m in self._line_re[rule_no].finditer(text):
                if starts is None:
                    starts = _line_starts(lines)
                out.add((bisect.bisect_right(starts, m.start()) - 1, rule_no))
        return out


def _collect(rule_no: int, _start: int, end: int, _flags: int, hits: list[tuple[int, int]]) -> None:
    """Hyperscan's match callback: (end offset, rule) into the list given as the scan's context."""
    hits.append((end, rule_no))


def _hit_lines(data: bytes, hits: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int, list[int]]]:
    """Each line of ``data`` the sorted (end offset, rule) ``hits`` fall in, once: its start, its end (exclusive, at
    its newline or the buffer's end) and the rules that hit it, each once, in the order they first did."""
    start, stop = 0, -1
    rules: list[int] = []
    for end, rule_no in hits:
        at = end - 1 if end else 0  # a match ending right after a newline belongs to the line before
        if at > stop:
            if rules:
                yield start, stop, rules
            start = data.rfind(b"\n", 0, at) + 1
            stop = data.find(b"\n", at)
            stop = len(data) if stop < 0 else stop
            rules = []
        if rule_no not in rules:
            rules.append(rule_no)
    if rules:
        yield start, stop, rules


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
                    out.append(LineMatch(i, rule, {k: v for k, v in m.groupdict().items() if v is not None}))
        return out
