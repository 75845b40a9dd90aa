"""Log text as people and tools print it, turned into events the rules read.

Two steps, both linear in the lines of a file:

- :func:`strip_prefix` takes one line's transport prefix off (dmesg plain, ``-T``, ``-H``,
  relative and ``-x``; ``/dev/kmsg`` records; RFC 3164 and RFC 5424 syslog; journalctl
  ``short``, ``short-iso``, ``short-precise``; a bare ``kernel:``) and says what the prefix
  told: host, program, whether it is the kernel's.
- :func:`group_events` folds the lines that form one event into one text: PCIe AER dumps
  with their status/mask lines, NVRM messages split over lines, Python tracebacks (the
  final exception line is the event), ``nvidia-smi -q`` sections, ``dcgmi`` table rows
  continued on the next row, prefixed lines that a forum or terminal wrapped, and the pieces of
  lines a terminal cut at its own width in a paste that carries no prefix at all.

Used where text arrives as a file or a paste (``kmend analyze``) and by the agent's
``/dev/kmsg`` source, whose records are one line each: the service sees the same events.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

from collector.wrapped import MAX_CUTS, own_width_cuts

_PREFIX = re.compile(
    r"""^(?:<\d{1,3}>)?
    (?:
        (?P<kpri>\d{1,3}),(?P<kseq>\d+),(?P<kusec>\d+),[^;\s]*;                      # /dev/kmsg record
      | 1\ (?P<stamp5424>\d{4}-\d\d-\d\dT\S+)\ (?P<host5424>\S+)\ (?P<app5424>\S+)
        \ \S+\ \S+\ (?:-|(?:\[[^\]]*\])+)\ ?                                          # RFC 5424
      | (?P<stamp>\w{3}\ +\d{1,2}\ \d\d:\d\d:\d\d(?:\.\d+)?
                 |\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)
        \ (?:(?P<host>[\w.-]+)\ )?(?P<app>[\w./@-]+)(?:\[\d+\])?:\ ?                  # RFC 3164, journalctl
      | (?P<fac>[a-z]+\ *:[a-z]+\ *:)\ ?                                             # dmesg -x
      | (?P<bare>kernel):\x20
    )?
    (?:
        (?P<dm>\[\ *(?P<rel>\+)?\d+[.,]\d+(?:\ *<\ *\+?\d+[.,]\d+>)?\])\ ?                # dmesg, -d, relative
      | \[(?P<dmt>\w{3}\ \w{3}\ +\d{1,2}\ \d\d:\d\d:\d\d\ \d{4})\]\ ?                 # dmesg -T
      | \[(?P<dmh>\w{3}\d{1,2}\ \d\d:\d\d)\]\ ?                                       # dmesg -H
    )?""",
    re.X,
)


_END = operator.methodcaller("end")


def prefix_lengths(lines: Sequence[str]) -> list[int]:
    """Length of each line's transport prefix (0 for none), the whole loop in C."""
    return list(map(_END, map(_PREFIX.match, lines)))


def without_prefixes(lines: Sequence[str], lengths: Sequence[int]) -> list[str]:
    """The lines with their prefixes cut off (the slicing done in C)."""
    return list(map(operator.getitem, lines, map(slice, lengths, itertools.repeat(None))))


@dataclass(frozen=True, slots=True)
class Prefix:
    """What one line's transport prefix said."""

    length: int
    """Characters of prefix before the message (0 when there was none)."""
    host: str | None
    """Host named by a syslog or journald prefix."""
    kernel: bool
    """The prefix says the kernel wrote the line (dmesg stamp, kmsg record, ``kernel:``)."""


NO_PREFIX = Prefix(0, None, False)
"""What a line without a transport prefix has."""


def strip_prefix(line: str) -> Prefix:
    """The transport prefix at the start of ``line`` (length 0 when it has none)."""
    m = _PREFIX.match(line)
    if m is None or m.end() == 0:
        return NO_PREFIX
    g = m.groupdict()
    app = g["app"] or g["app5424"]
    kernel = (app == "kernel" or g["kseq"] is not None or g["fac"] is not None or g["bare"] is not None
              or g["dm"] is not None or g["dmt"] is not None or g["dmh"] is not None)
    if g["stamp"] is None and g["stamp5424"] is None and m.group(0).strip() == "":
        return NO_PREFIX
    host = g["host"] or g["host5424"]
    return Prefix(m.end(), host if host not in (None, "-") else None, kernel)


# Lines of a PCIe AER report: a head opens a report, the others belong to the open one.
_AER_RECEIVED = re.compile(r"AER: (?:Multiple )?(?:Corrected|Correctable|Uncorrected|Uncorrectable)\b.*received")
_AER_BODY = re.compile(
    r"AER:|error status/mask=|TLP Header|:\s+\[\s*\d+\] [A-Za-z]|Error of this Agent|error_detected|"
    r"device recovery|Device recovery|link reset|slot reset|resume"
)
_SPECIAL = re.compile(
    r"Traceback|AER|PCIe Bus Error|error status/mask|TLP Header|NVRM: |^GPU |^\[(?:rank|default)\d+\]:|:\s+\[\s*\d+\] "
)
"""Text any line that starts or continues a multi-line event contains (the fast path's gate)."""
_TRACEBACK = "Traceback (most recent call last):"


def may_continue(text: str) -> bool:
    """Whether a line could open or continue a multi-line event, so the next lines may still join it."""
    return _SPECIAL.search(text) is not None


_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# Lines PyTorch prints under a final exception line that still belong to it.
_EXC_TAIL = re.compile(
    r"^(?:nccl\w*Error|Last error:|CUDA kernel errors|For debugging|Compile with|"
    r"Exception raised from|frame #\d|Error \d+: |c10::)"
)
_RANK = re.compile(r"^\[(?:rank|default)\d+\]: ?")
_GPU_HEAD = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_KEY_VALUE = re.compile(r"\s+:\s*|\s*:\s+")
_TABLE_ROW = re.compile(r"^\|\s*(.*?)\s*\|\s*(.*?)\s*\|\s*$")
_TERMINAL_WIDTHS = frozenset({80, 100, 120, 132, 160, 200, 240})
"""Widths at which a terminal breaks a line mid-word (a forum breaks at a space)."""
# A trainer's own record prefix (torchrun's "[rank3]:" before glog's "E0321 02:07:08"): a line without
# one that starts mid-word right after one is the rest of a line the terminal wrapped.
_RECORD = re.compile(r"^(?:\[(?:rank|default)\d+\]:)?\[?[IWEF]\d{3,4} \d\d:\d\d:\d\d")
_DEVICE_LINE = re.compile(r"^\S+ [0-9a-fA-F]{4}:[0-9a-fA-F]{2}:")
_MAX_WRAPS = 8
"""Most continuation lines joined to one prefixed line."""
_MAX_FOLD = 200
"""Most lines folded into one event, so a malformed file cannot build one huge text."""


def _indent(s: str) -> int:
    return len(s) - len(s.lstrip(" "))


def _flatten_section(header: str, body: Sequence[str]) -> str:
    """``Header: Key: value, Sub: Key: value`` from an indented ``nvidia-smi -q`` section."""
    parts = []
    for ln in body:
        s = ln.strip()
        parts.append(_KEY_VALUE.sub(": ", s, count=1) if ":" in s else s + ":")
    return header.strip() + ": " + ", ".join(parts).replace(":,", ":")


class _Folder:
    """State of :func:`group_events` while it walks one file."""

    def __init__(self, texts: Sequence[str], raw: Sequence[str], prefixed: Sequence[bool],
                 widths: frozenset[int], cuts: frozenset[int] = frozenset()) -> None:
        self.texts, self.raw, self.prefixed, self.widths = texts, raw, prefixed, widths
        self.cuts = cuts  # lines that are the rest of the line above, cut at the file's own width
        self.heads: list[int] = []  # line of each event
        self.out: list[str] = []  # text of each event (its first part until the end)
        self.parts: dict[int, list[str]] = {}  # parts of the events that folded more lines
        self.open_aer = -1  # index into events of the AER report still taking lines
        self.aer_head = ""  # what opened that report: "received", "bus" or "body"
        self.aer_received = False  # the report already has its "error received" line
        self.tracebacks: dict[str, int] = {}  # rank prefix -> line the open traceback began
        self.exc_event: dict[str, int] = {}  # rank prefix -> event of the last exception line
        self.gpu = ""
        self.wrapped = 0

    def add(self, i: int, text: str) -> None:
        self.heads.append(i)
        self.out.append(text)

    def bulk(self, start: int, stop: int) -> None:
        """Lines ``start``..``stop`` are events of their own (the common case, done in C)."""
        self.heads.extend(range(start, stop))
        self.out.extend(self.texts[start:stop])

    def last_part(self) -> str:
        idx = len(self.out) - 1
        parts = self.parts.get(idx)
        return parts[-1] if parts else self.out[idx]

    def extend(self, text: str, sep: str = " ") -> None:
        idx = len(self.out) - 1
        parts = self.parts.get(idx)
        if parts is None:
            parts = self.parts[idx] = [self.out[idx]]
        if len(parts) < _MAX_FOLD:
            parts.append(sep + text)

    def traceback(self, i: int, text: str) -> bool:
        """Fold traceback lines; True when the line was taken."""
        m = _RANK.match(text)
        key = m.group(0) if m else ""
        body = text[len(key):].lstrip(" ") if key else text
        if body.startswith(_TRACEBACK):
            self.tracebacks[key] = i
            self.exc_event.pop(key, None)
            return True
        if key in self.tracebacks:
            rest = text[len(key):]
            if not rest.strip() or rest[:1] in (" ", "\t", "^") or rest.lstrip().startswith(_CHAINED):
                return True
            del self.tracebacks[key]
            self.add(i, text)
            self.exc_event[key] = len(self.out) - 1
            return True
        if key in self.exc_event:
            if _EXC_TAIL.match(body) and self.exc_event[key] == len(self.out) - 1:
                self.extend(body)
                return True
            del self.exc_event[key]
        return False

    def aer(self, i: int, text: str) -> bool:
        """Fold a PCIe AER report: the root port's "error received" line, each device's
        "PCIe Bus Error" line with its status/mask and bit lines, and the recovery lines."""
        received = _AER_RECEIVED.search(text) is not None
        bus = not received and "PCIe Bus Error:" in text
        is_open = self.open_aer >= 0 and self.open_aer == len(self.out) - 1
        if received or bus:
            # One report names every device it covers; a second report starts a new event, so
            # a storm of corrected errors still counts report by report.
            if is_open and ((bus and self.aer_head == "received")
                            or (received and self.aer_head == "bus" and not self.aer_received)):
                self.aer_received = self.aer_received or received
                self.extend(text)
                return True
            self.add(i, text)
            self.open_aer = len(self.out) - 1
            self.aer_head = "received" if received else "bus"
            self.aer_received = received
            return True
        if _AER_BODY.search(text):
            if is_open:
                self.extend(text)
            elif "AER:" not in text:
                self.open_aer = -1
                return False
            else:
                self.add(i, text)
                self.open_aer = len(self.out) - 1
                self.aer_head, self.aer_received = "body", False
            return True
        self.open_aer = -1
        return False

    def nvrm(self, i: int, text: str) -> bool:
        """An ``NVRM:`` line that continues the sentence of the one before it."""
        if not text.startswith("NVRM: ") or not self.out:
            return False
        rest = text[6:]
        folded = len(self.parts.get(len(self.out) - 1, ())) or 1
        if (self.out[-1].startswith("NVRM: ") and (rest[:1].islower() or rest[:1] == "(")
                and not self.last_part().rstrip().endswith((".", "!", ":"))
                and self.heads[-1] >= i - folded):
            self.extend(rest)
            return True
        return False

    def section(self, i: int, n: int) -> int:
        """Fold an indented ``nvidia-smi -q`` section starting at line ``i``; returns the next line to read."""
        head = self.texts[i]
        depth = _indent(head)
        j = i + 1
        while j < n and j - i <= _MAX_FOLD and (not self.texts[j].strip() or _indent(self.texts[j]) > depth):
            j += 1
        body = [t for t in self.texts[i + 1:j] if t.strip()]
        prefix = f"GPU {self.gpu} " if self.gpu else ""
        self.add(i, prefix + _flatten_section(head, body))
        return j

    def table_row(self, i: int, text: str) -> bool:
        """A ``dcgmi`` table row; a row with an empty first cell continues the row above."""
        m = _TABLE_ROW.match(text)
        if m is None:
            return False
        key, value = m.group(1), m.group(2)
        if not key and not value:
            return True
        if not key and self.out and self.out[-1].startswith("| "):
            self.extend(value)
        else:
            self.add(i, f"| {key}: {value}" if key else f"| {value}")
        return True

    def wrap(self, i: int, text: str) -> bool:
        """An unprefixed line right after prefixed ones: the rest of a line that was wrapped."""
        if not self.out or self.prefixed[i] or not text:
            return False
        head = self.heads[-1]
        if head + 1 + self.wrapped != i:
            return False
        if i in self.cuts and self.wrapped < MAX_CUTS:
            self.extend(text, "")
            self.wrapped += 1
            return True
        if self.wrapped >= _MAX_WRAPS:
            return False
        # Only a mid-word break continues a trainer's record; its other plain lines are their own.
        if not self.prefixed[head] and not (
                text[0].islower() and _RECORD.match(self.texts[head]) and not _RECORD.match(text)):
            return False
        if text[0] in " \t":
            # dmesg prints the later lines of a multi-line record indented under the first one's text.
            if _indent(text) < 8:
                return False
            text = text.strip()
            if text.startswith("NVRM: ") and self.out[-1].startswith("NVRM: "):
                text = text[6:]
            self.extend(text)
        elif text[0] in "|+=-#$[" or not _continues(text):
            return False
        elif len(self.raw[i - 1]) in self.widths:
            self.extend(text, "")
        elif (text[0].islower() and len(self.raw[i - 1]) >= 60
              and self.last_part().rstrip()[-1:] not in ".!?:;)]}>"):
            # A forum breaks a long line at a space, mid-sentence: the rest starts lower-case and is
            # no record of its own (no "host:pid:tid", no "driver 0000:3b:00.0:").
            self.extend(text)
        else:
            return False
        self.wrapped += 1
        return True


def _is_section_head(texts: Sequence[str], i: int, n: int) -> bool:
    """``nvidia-smi -q`` section: an indented title without a value, its lines indented deeper."""
    t = texts[i]
    if ":" in t or i + 1 >= n or t.startswith(("|", "+")):
        return False
    nxt = texts[i + 1]
    return _indent(nxt) > _indent(t) and " : " in nxt


def _terminal_widths(texts: Sequence[str], raw: Sequence[str], prefixed: Sequence[bool],
                     marks: Sequence[int]) -> frozenset[int]:
    """Line widths at which this file was wrapped mid-word: the common ones, and any width at which
    two different record lines break onto a line that starts mid-word (a terminal's own width)."""
    seen: dict[int, set[str]] = {}
    for i in marks:
        t = texts[i]
        if (i > 0 and t[:1].islower() and not prefixed[i] and _continues(t)
                and (prefixed[i - 1] or _RECORD.match(texts[i - 1]))):
            seen.setdefault(len(raw[i - 1]), set()).add(texts[i - 1])
    return _TERMINAL_WIDTHS | {w for w, heads in seen.items() if len(heads) >= 2 and w >= 80}


def _continues(text: str) -> bool:
    """A line that can be the rest of another: it names no host:pid:tid or device of its own."""
    return ":" not in text.split(" ", 1)[0] and _DEVICE_LINE.match(text) is None


@dataclass(frozen=True, slots=True)
class Events:
    """The events of a file: line ``lines[k]`` heads event ``k`` whose text is ``texts[k]``."""

    lines: list[int]
    """Index of the line that carries each event's meaning (its head, or a traceback's exception line)."""
    texts: list[str]
    """What the rules see: one line per event, the folded lines joined."""


# Text on the lines the fold must look at (everything between two of them is an event of its own).
# Plain substrings: str.find skips the rest of the file in C, where a regex alternation would not.
_NEEDLES = ("Traceback", "AER", "PCIe Bus Error", "error status/mask", "TLP Header", "NVRM: ", ":    [",
            "error_detected", "evice recovery", "\nGPU ", "\n ", "\n\t", "\n|", "\n+", "\n\n")
# torchrun's "[rank3]:[E424 ..." record: the line after it may be its terminal-wrapped rest.
_RECORD_NEEDLE = "]:["


def _find_all(text: str, needle: str) -> list[int]:
    out: list[int] = []
    at = text.find(needle)
    while at >= 0:
        out.append(at)
        at = text.find(needle, at + 1)
    return out


def _marks(texts: Sequence[str], prefixed: Sequence[bool]) -> list[int]:
    """Lines that may start, continue or close a multi-line event, found by C scans of the file."""
    joined = "\n".join(texts)
    starts = list(itertools.accumulate(map(len, texts[:-1]), lambda a, b: a + b + 1, initial=0))
    n = len(texts)
    marks: set[int] = set()
    for needle in _NEEDLES:
        newline = needle.startswith("\n")
        for at in _find_all(joined, needle):
            line = bisect.bisect_right(starts, at) - 1 + newline
            marks.add(line)
            if needle in ("\n ", "\n\t"):
                marks.add(line - 1)  # an indented line: the one above may be its section's title
    if texts and texts[0][:1] in (" ", "\t", "|", "+", ""):
        marks.add(0)
    for at in _find_all(joined, _RECORD_NEEDLE):
        line = bisect.bisect_right(starts, at) - 1
        if line + 1 < n and texts[line + 1][:1].islower():
            marks.update((line, line + 1))
    marks.update(i for i in range(1, n) if prefixed[i - 1] and not prefixed[i])
    marks.discard(-1)
    return sorted(m for m in marks if m < n)


def group_events(texts: Sequence[str], raw: Sequence[str] | None = None,
                 prefixed: Sequence[bool] | None = None) -> Events:
    """The events of a file's lines (prefixes already stripped into ``texts``).

    ``raw`` holds the lines as read (their length tells a terminal wrap from a forum's) and
    ``prefixed`` which lines carried a transport prefix. Blank lines and ``/dev/kmsg``
    ``KEY=value`` continuation lines are no events. Linear in the file: C scans find the lines
    that need looking at, and only those (and the lines of an open traceback) cost Python steps.
    """
    n = len(texts)
    raw = raw if raw is not None else texts
    prefixed = prefixed if prefixed is not None else [False] * n
    marks = _marks(texts, prefixed) if n else []
    cuts = own_width_cuts(texts, raw, prefixed, (_RECORD, _DEVICE_LINE))
    if cuts:
        marks = sorted(set(marks).union(cuts))
    fold = _Folder(texts, raw, prefixed, _terminal_widths(texts, raw, prefixed, marks), cuts)
    i = pos = 0
    while i < n:
        if not fold.tracebacks and not fold.exc_event:
            pos = bisect.bisect_left(marks, i, pos)
            nxt = marks[pos] if pos < len(marks) else n
            if nxt > i:
                fold.bulk(i, nxt)
                fold.wrapped, fold.open_aer = 0, -1
                i = nxt
                continue
        text = texts[i]
        if not text.strip():
            fold.open_aer = -1
            i += 1
            continue
        if fold.traceback(i, text):
            i += 1
            continue
        if raw[i].startswith(" ") and "=" in text and i > 0 and prefixed[i - 1] and raw[i - 1][:1].isdigit():
            i += 1  # /dev/kmsg dictionary line (" SUBSYSTEM=pci"): metadata of the record above
            continue
        if (g := _GPU_HEAD.match(text)) is not None:
            fold.gpu = g.group(1)
        if _is_section_head(texts, i, n):
            i = fold.section(i, n)
            continue
        if not (fold.aer(i, text) or fold.nvrm(i, text) or fold.table_row(i, text) or fold.wrap(i, text)):
            fold.add(i, text)
            fold.wrapped = 0
        i += 1
    for idx, parts in fold.parts.items():
        fold.out[idx] = "".join(parts)
    return Events(fold.heads, fold.out)


def events_of(text: str) -> list[str]:
    """Event texts of a pasted block of lines (prefixes stripped, multi-line events folded)."""
    lines = text.splitlines()
    prefixes = [strip_prefix(ln) for ln in lines]
    bare = [ln[p.length:] for ln, p in zip(lines, prefixes, strict=True)]
    return group_events(bare, lines, [p.length > 0 for p in prefixes]).texts
