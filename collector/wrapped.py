"""Lines a terminal cut at its own width, in a file whose lines carry no prefix to tell the pieces apart.

A terminal prints no line longer than it is wide, so a capture or paste it wrapped has its longest lines
all of one width, each broken mid-token onto the next line. :func:`own_width_cuts` finds that width and
the lines that are the rest of the line above; :mod:`collector.normalize` joins them back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_CUTS = 64
"""Most pieces of one line joined back at a file's own terminal width (a 9,000-character line at 140)."""
_MIN_WIDTH = 80
"""Narrowest terminal a file's own width is inferred for."""
# A terminal cuts at its width whatever is there: the last character of the cut line and the first of the
# rest sit inside one token (a word, a path, a number), or the rest opens with the one space between two.
_CUT_LAST = re.compile(r"[\w/\\.=,;:'\"()\[\]{}<>@%+*-]")
_CUT_FIRST = re.compile(r"(?:[a-z0-9_/\\.,;:)\]}'\"%=-]| [\w/-])")
_STAMP_START = re.compile(r"\d{4}[-/]\d\d[-/]\d\d|\d\d:\d\d:\d\d|[A-Z][a-z]{2} [ \d]\d \d\d:\d\d")
"""The stamp a record of its own starts with (ISO date, clock time, syslog's ``Oct 23 10:03:12``)."""
_COLUMNS = re.compile(r"\S {3,}\S")
"""Columns of a table (``kubectl get``, ``ps``): its rows end at the same width and start a new row."""


def _first_word(text: str) -> str:
    return text.split(" ", 1)[0]


def _cut_here(record: str, cut: str, rest: str, records: Sequence[re.Pattern[str]]) -> bool:
    """Whether ``rest`` reads as the rest of ``cut`` (a piece of ``record``), broken by a terminal:
    mid-token, no table row, no record of its own (no stamp, none of ``records``, no ``host:pid`` as its
    first word, not the first word the record itself starts with)."""
    word = _first_word(rest) if rest[:1] != " " else ""
    return (_CUT_LAST.match(cut[-1]) is not None and _CUT_FIRST.match(rest) is not None
            and ":" not in word[:-1] and _COLUMNS.search(cut) is None and _STAMP_START.match(rest) is None
            and all(p.match(rest) is None for p in records) and word != _first_word(record))


def own_width_cuts(texts: Sequence[str], raw: Sequence[str], prefixed: Sequence[bool],
                   records: Sequence[re.Pattern[str]] = ()) -> frozenset[int]:
    """Lines of a file (``texts``, prefixes cut off; ``raw`` as read) that continue the unprefixed line
    above, cut at the file's own width; ``records`` are patterns a line of its own starts with.

    The width is the file's longest line, taken when at least two different lines of that length break
    mid-token and no more than a few of its lines of that length break otherwise (a file of records that
    merely share a length, or a table). Linear: the lengths are measured in C and only lines of that
    length are looked at.
    """
    n = len(raw)
    if n < 2:
        return frozenset()
    lengths = list(map(len, raw))
    width = max(lengths)
    if width < _MIN_WIDTH or lengths.count(width) < 2:
        return frozenset()
    cuts: set[int] = set()
    heads: set[str] = set()
    other = 0
    at = lengths.index(width)
    while True:
        nxt = at + 1
        if nxt < n and not prefixed[at] and not prefixed[nxt] and texts[nxt].strip():
            record = at
            while record in cuts:
                record -= 1
            if _cut_here(texts[record], raw[at], texts[nxt], records):
                cuts.add(nxt)
                heads.add(raw[at])
            else:
                other += 1
        try:
            at = lengths.index(width, at + 1)
        except ValueError:
            break
    return frozenset(cuts) if len(heads) >= 2 and other <= len(cuts) // 4 else frozenset()
