"""Confirming a prefilter hit: one rule's own RE2 regex run on the line a hyperscan hit points at."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

from analyzer.exact import hyperscan_exact
from analyzer.rules import Rule


class Confirmer:
    """One rule's own regex run on a line a hyperscan hit points at: confirms it and extracts its fields.

    An ASCII line is searched as the bytes the scan already holds, with the pattern compiled for
    bytes: no encoding and no offset conversion per call, and ASCII bytes mean the same to RE2 as
    the text. Any other line is searched as text. Both are RE2, linear in the line.

    The bytes pattern is ``(?s:.*?)(?:pattern)`` matched anchored at the line's start: the same
    leftmost-first match as an unanchored search (RE2 itself searches by prefixing that loop), but
    RE2 then extracts the groups of a line of up to about a kilobyte in one bit-state pass instead of
    a forward DFA, a reverse DFA and that pass. The DFAs' state caches are what a confirmation after a
    large scan finds cold: this halves the cost of confirming a hit.
    """

    __slots__ = ("_bytes", "_names", "_spans", "_text", "exact")

    def __init__(self, rule: Rule) -> None:
        import re2

        opts = re2.Options()
        opts.log_errors = False
        self._text = rule.regex
        pattern = rule.pattern.encode("utf-8")
        self._bytes = re2.compile(pattern, options=opts)
        # The compiled RE2 object's own Match (spans of every group in one call) costs a fifth of the
        # wrapper's search() with its match object; where this google-re2 does not expose it, search().
        anchor = getattr(getattr(getattr(re2, "_re2", None), "RE2", None), "Anchor", None)
        self._spans: Callable[[bytes, int, int], list[tuple[int, int]]] | None = None
        if anchor is not None:
            try:
                led = re2.compile(b"(?s:.*?)(?:" + pattern + b")", options=opts)
            except re2.error:
                led = None
            if led is not None and getattr(getattr(led, "_regexp", None), "Match", None) is not None:
                self._spans = functools.partial(led._regexp.Match, anchor.ANCHOR_START)
            elif (match := getattr(getattr(self._bytes, "_regexp", None), "Match", None)) is not None:
                self._spans = functools.partial(match, anchor.UNANCHORED)
        self._names = tuple(sorted(rule.regex.groupindex.items(), key=operator.itemgetter(1)))
        self.exact = not self._names and hyperscan_exact(rule.pattern)
        """A hyperscan hit on an ASCII line is the rule's match there, with nothing to extract."""

    def ascii(self, line: bytes, *, hit: bool = False) -> dict[str, str] | None:
        """Named groups of the rule's match on an ASCII line, or None when it does not match.

        ``hit``: hyperscan reported a match ending in this line, as it reads (nothing cut off it).
        """
        if hit and self.exact:
            return {}
        if self._spans is not None:
            spans = self._spans(line, 0, len(line))
            if spans[0][0] < 0:
                return None
            return {name: line[a:b].decode("ascii") for name, idx in self._names
                    if (a := spans[idx][0]) >= 0 and (b := spans[idx][1]) >= 0}
        m = self._bytes.search(line)
        if m is None:
            return None
        out: dict[str, str] = {}
        for name, idx in self._names:
            a, b = m.span(idx)
            if a >= 0:
                out[name] = line[a:b].decode("ascii")
        return out

    def text(self, line: str) -> dict[str, str] | None:
        """Named groups of the rule's match on a line of text, or None when it does not match."""
        m = self._text.search(line)
        if m is None:
            return None
        return {k: v for k, v in m.groupdict().items() if v is not None}
