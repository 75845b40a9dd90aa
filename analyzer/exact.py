"""Which rule patterns hyperscan matches exactly, so a hit on an ASCII line needs no RE2 confirmation.

The hyperscan database scans a whole batch as one text in multi-line mode; a hit is a match of the
same pattern on the line the hit ends in, unless a match could run over a newline into the line
before. A pattern none of whose parts can match a newline cannot do that, and on ASCII text (one
byte per character) hyperscan and RE2 read it alike. Such a rule without named groups has nothing
to extract, so its hit is its finding.

The pattern is read with Python's own regex parser; anything it does not read the way RE2 does
(POSIX classes, ``\\Q...\\E``, ``\\p{..}``, ``\\z``) or that this module does not know is not exact,
and is confirmed by RE2 as before.
"""

from __future__ import annotations

import re

# The standard library's own regex parser (named privately since Python 3.11; its tree is stable).
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

_NL = ord("\n")
# Categories whose sets hold the newline (\s, \D, \W and their Unicode forms).
_NL_CATEGORIES = frozenset({
    sre.CATEGORY_SPACE, sre.CATEGORY_NOT_DIGIT, sre.CATEGORY_NOT_WORD,
    sre.CATEGORY_UNI_SPACE, sre.CATEGORY_UNI_NOT_DIGIT, sre.CATEGORY_UNI_NOT_WORD,
    sre.CATEGORY_LINEBREAK, sre.CATEGORY_UNI_LINEBREAK,
})
# Not "$": the database reads it as "\r*$" (see hyperscan_pattern), which a line ending in "\r" fails in RE2.
_SAFE_AT = frozenset({sre.AT_BEGINNING, sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY})
# Syntax Python parses differently from RE2 (or not at all): never called exact.
_FOREIGN = re.compile(r"\[:|\\[QEpPzCx]|\(\?[a-zA-Z]*[sU]")


def hyperscan_exact(pattern: str) -> bool:
    """Whether a hyperscan hit of ``pattern`` on an ASCII line is a match of it on that line."""
    if _FOREIGN.search(pattern):
        return False
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError):
        return False
    if tree.state.flags & (re.DOTALL | re.VERBOSE):
        return False
    return not _can_match_newline(tree)


def can_span_lines(pattern: str) -> bool:
    """Whether a match of ``pattern`` could run over a newline (or the pattern is not understood here).

    A rule's pattern describes one line: in a buffer of joined lines, a match that ran from one line
    into the next would belong to neither, and in the per-rule fallbacks it would hide the next line's
    own match. Shipped rules are held to False by a test.
    """
    if _FOREIGN.search(pattern):
        return True
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError):
        return True
    return bool(tree.state.flags & (re.DOTALL | re.VERBOSE)) or _can_match_newline(tree, spans=True)


def _can_match_newline(items: Any, spans: bool = False) -> bool:
    """Whether any part of a parsed pattern can match a newline (or is not understood).

    ``spans``: the question is only whether a match can run over a newline (zero-width anchors are
    fine, and a negated set that names the newline never holds it, whatever else it leaves out).
    """
    for op, arg in items:
        if op is sre.LITERAL:
            if arg == _NL:
                return True
        elif op is sre.NOT_LITERAL:
            if arg != _NL:
                return True
        elif op is sre.ANY:
            continue  # without DOTALL, "." stops at a newline in RE2 and in hyperscan alike
        elif op is sre.IN:
            if _set_has_newline(arg, spans):
                return True
        elif op is sre.AT:
            if arg not in _SAFE_AT and not spans:
                return True
        elif op is sre.BRANCH:
            if any(_can_match_newline(alt, spans) for alt in arg[1]):
                return True
        elif op is sre.SUBPATTERN:
            _group, add_flags, _del_flags, sub = arg
            if add_flags & (re.DOTALL | re.VERBOSE) or _can_match_newline(sub, spans):
                return True
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            if _can_match_newline(arg[2], spans):
                return True
        else:
            return True  # not understood here: let RE2 decide
    return False


def _set_has_newline(items: Any, spans: bool = False) -> bool:
    negated = bool(items) and items[0][0] is sre.NEGATE
    if spans and negated and any(op is sre.LITERAL and arg == _NL for op, arg in items[1:]):
        return False  # [^...\n]: whatever else it leaves out, never the newline
    holds = False
    for op, arg in items[1:] if negated else items:
        if op is sre.LITERAL:
            holds = holds or arg == _NL
        elif op is sre.RANGE:
            holds = holds or arg[0] <= _NL <= arg[1]
        elif op is sre.CATEGORY:
            holds = holds or arg in _NL_CATEGORIES
            if negated:
                return True  # a category inside a negated set: not worth reasoning about
        else:
            return True
    return holds != negated


def hyperscan_pattern(pattern: str) -> str:
    """The pattern as the hyperscan database holds it: every ``$`` also matches before carriage returns,
    and ``\\S`` also matches a vertical tab (RE2's ``\\s`` leaves it out, hyperscan's takes it in).

    A log file written with CRLF line ends reaches the rules without the ``\\r`` (its lines are
    stripped), but the scan reads the bytes as they are: ``\\r*$`` keeps an anchored rule's hits there.
    The database is a prefilter, so matching more is safe: RE2 decides on the line itself.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            # The vertical tab by its code: in a class, hyperscan (as PCRE) reads "\\v" as every vertical
            # space, carriage return and newline included, so "[\\S\\v]" ran over line ends.
            out.append("[\\S\\x0b]" if pattern[i + 1:i + 2] == "S" else pattern[i:i + 2])
            i += 2
            continue
        if ch == "[":
            # A class runs to its first "]" that is not its first member nor the end of a [:name:].
            j = i + 1
            j += pattern[j:j + 1] == "^"
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                if pattern[j] == "\\":
                    j += 1
                elif pattern.startswith("[:", j):
                    end = pattern.find(":]", j + 2)
                    j = end + 1 if end >= 0 else j
                j += 1
            cls = pattern[i:j + 1]
            out.append(cls if cls.startswith("[^") else cls.replace("\\S", "\\S\\v"))
            i = j + 1
            continue
        if ch == "$":
            out.append("\\r*")
        out.append(ch)
        i += 1
    return "".join(out)
