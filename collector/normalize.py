"""Log text as people and tools print it, turned into events the rules read.

Two steps, both linear in the lines of a file:

- :func:`strip_prefix` takes one line's transport prefix off (dmesg plain, ``-T``, ``-H``,
  relative and ``-x``; ``/dev/kmsg`` records; RFC 3164 and RFC 5424 syslog; journalctl
  ``short``, ``short-iso``, ``short-precise``; a bare ``kernel:``) and says what the prefix
  told: host, program, whether it is the kernel's.
- :func:`group_events` folds the lines that form one event into one text: PCIe AER dumps
  with their status/mask lines, NVRM messages split over lines, Python tracebacks (the
  final exception line is the event), ``nvidia-smi -q`` sections, ``dcgmi`` table rows
  continued on the next row, and prefixed lines that a forum or terminal wrapped.

Used where text arrives as a file or a paste (``kmend analyze``); the agent's sources
already ship one clean message per signal, so the service path does not pay for this.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

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
        \[\ *(?P<rel>\+)?\d+[.,]\d+(?:\ *<\ *\+?\d+[.,]\d+>)?\]\ ?                      # dmesg, -d, relative
      | \[(?P<dmt>\w{3}\ \w{3}\ +\d{1,2}\ \d\d:\d\d:\d\d\ \d{4})\]\ ?                 # dmesg -T
      | \[(?P<dmh>\w{3}\d{1,2}\ \d\d:\d\d)\]\ ?                                       # dmesg -H
    )?""",
    re.X,
)
_KERNEL_GROUPS = ("kseq", "fac", "bare", "rel", "dmt", "dmh")


@dataclass(frozen=True, slots=True)
class Prefix:
    """What one line's transport prefix said."""

    length: int
    """Characters of prefix before the message (0 when there was none)."""
    host: str | None
    """Host named by a syslog or journald prefix."""
    kernel: bool
    """The prefix says the kernel wrote the line (dmesg stamp, kmsg record, ``kernel:``)."""


_NONE = Prefix(0, None, False)


def strip_prefix(line: str) -> Prefix:
    """The transport prefix at the start of ``line`` (length 0 when it has none)."""
    m = _PREFIX.match(line)
    if m is None or m.end() == 0:
        return _NONE
    g = m.groupdict()
    app = g["app"] or g["app5424"]
    kernel = app == "kernel" or any(g[k] is not None for k in _KERNEL_GROUPS)
    if g["stamp"] is None and g["stamp5424"] is None and m.group(0).strip() == "":
        return _NONE
    host = g["host"] or g["host5424"]
    return Prefix(m.end(), host if host not in (None, "-") else None, kernel)


@dataclass(frozen=True, slots=True)
class Event:
    """One event: the lines of a file that belong together, as one text."""

    line: int
    """Index of the line that carries the event's meaning (its head, or a traceback's exception line)."""
    text: str
    """What the rules see: one line, the folded lines joined."""


# Lines of a PCIe AER report: a head opens a report, the others belong to the open one.
_AER_RECEIVED = re.compile(r"AER: (?:Multiple )?(?:Corrected|Correctable|Uncorrected|Uncorrectable)\b.*received")
_AER_BODY = re.compile(
    r"AER:|error status/mask=|TLP Header|\[\s*\d+\] [A-Za-z]|Error of this Agent|error_detected|"
    r"device recovery|Device recovery|link reset|slot reset|resume"
)
_TRACEBACK = "Traceback (most recent call last):"
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
                 widths: frozenset[int]) -> None:
        self.texts, self.raw, self.prefixed, self.widths = texts, raw, prefixed, widths
        self.events: list[tuple[int, list[str]]] = []
        self.open_aer = -1  # index into events of the AER report still taking lines
        self.aer_head = ""  # what opened that report: "received", "bus" or "body"
        self.aer_received = False  # the report already has its "error received" line
        self.tracebacks: dict[str, int] = {}  # rank prefix -> line the open traceback began
        self.exc_event: dict[str, int] = {}  # rank prefix -> event of the last exception line
        self.gpu = ""
        self.wrapped = 0

    def add(self, i: int, text: str) -> None:
        self.events.append((i, [text]))

    def extend(self, text: str, sep: str = " ") -> None:
        parts = self.events[-1][1]
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
            self.exc_event[key] = len(self.events) - 1
            return True
        if key in self.exc_event:
            if _EXC_TAIL.match(body) and self.exc_event[key] == len(self.events) - 1:
                self.extend(body)
                return True
            del self.exc_event[key]
        return False

    def aer(self, i: int, text: str) -> bool:
        """Fold a PCIe AER report: the root port's "error received" line, each device's
        "PCIe Bus Error" line with its status/mask and bit lines, and the recovery lines."""
        received = _AER_RECEIVED.search(text) is not None
        bus = not received and "PCIe Bus Error:" in text
        is_open = self.open_aer >= 0 and self.open_aer == len(self.events) - 1
        if received or bus:
            # One report names every device it covers; a second report starts a new event, so
            # a storm of corrected errors still counts report by report.
            if is_open and ((bus and self.aer_head == "received")
                            or (received and self.aer_head == "bus" and not self.aer_received)):
                self.aer_received = self.aer_received or received
                self.extend(text)
                return True
            self.add(i, text)
            self.open_aer = len(self.events) - 1
            self.aer_head = "received" if received else "bus"
            self.aer_received = received
            return True
        if _AER_BODY.search(text):
            if is_open:
                self.extend(text)
            else:
                self.add(i, text)
                self.open_aer = len(self.events) - 1
                self.aer_head, self.aer_received = "body", False
            return True
        self.open_aer = -1
        return False

    def nvrm(self, i: int, text: str) -> bool:
        """An ``NVRM:`` line that continues the sentence of the one before it."""
        if not text.startswith("NVRM: ") or not self.events:
            return False
        last = self.events[-1][1]
        rest = text[6:]
        if (last[0].startswith("NVRM: ") and (rest[:1].islower() or rest[:1] == "(")
                and not last[-1].rstrip().endswith((".", "!", ":"))
                and self.events[-1][0] >= i - len(last)):
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
        if not key and self.events and self.events[-1][1][0].startswith("| "):
            self.extend(value)
        else:
            self.add(i, f"| {key}: {value}" if key else f"| {value}")
        return True

    def wrap(self, i: int, text: str) -> bool:
        """An unprefixed line right after prefixed ones: the rest of a line that was wrapped."""
        if not self.events or self.prefixed[i] or not text or self.wrapped >= _MAX_WRAPS:
            return False
        head = self.events[-1][0]
        if head + 1 + self.wrapped != i:
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
            if text.startswith("NVRM: ") and self.events[-1][1][0].startswith("NVRM: "):
                text = text[6:]
            self.extend(text)
        elif text[0] in "|+=-#$[":
            return False
        else:
            self.extend(text, "" if len(self.raw[i - 1]) in self.widths else " ")
        self.wrapped += 1
        return True


def _is_section_head(texts: Sequence[str], i: int, n: int) -> bool:
    """``nvidia-smi -q`` section: an indented title without a value, its lines indented deeper."""
    t = texts[i]
    if ":" in t or i + 1 >= n or t.startswith(("|", "+")):
        return False
    nxt = texts[i + 1]
    return _indent(nxt) > _indent(t) and " : " in nxt


def _terminal_widths(texts: Sequence[str], raw: Sequence[str], prefixed: Sequence[bool]) -> frozenset[int]:
    """Line widths at which this file was wrapped mid-word: the common ones, and any width at which
    two or more record lines break onto a line that starts mid-word (a terminal's own width)."""
    seen: dict[int, int] = {}
    for i in range(1, len(texts)):
        t = texts[i]
        if t[:1].islower() and not prefixed[i] and (prefixed[i - 1] or _RECORD.match(texts[i - 1])):
            w = len(raw[i - 1])
            seen[w] = seen.get(w, 0) + 1
    return _TERMINAL_WIDTHS | {w for w, c in seen.items() if c >= 2 and w >= 80}


def group_events(texts: Sequence[str], raw: Sequence[str] | None = None,
                 prefixed: Sequence[bool] | None = None) -> list[Event]:
    """The events of a file's lines (prefixes already stripped into ``texts``).

    ``raw`` holds the lines as read (their length tells a terminal wrap from a forum's) and
    ``prefixed`` which lines carried a transport prefix; only prefixed files re-join wraps.
    Blank lines and ``/dev/kmsg`` ``KEY=value`` continuation lines are no events.
    """
    n = len(texts)
    raw = raw if raw is not None else texts
    prefixed = prefixed if prefixed is not None else [False] * n
    fold = _Folder(texts, raw, prefixed, _terminal_widths(texts, raw, prefixed))
    i = 0
    while i < n:
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
    return [Event(line, "".join(parts)) for line, parts in fold.events]


def events_of(text: str) -> list[str]:
    """Event texts of a pasted block of lines (prefixes stripped, multi-line events folded)."""
    lines = text.splitlines()
    prefixes = [strip_prefix(ln) for ln in lines]
    bare = [ln[p.length:] for ln, p in zip(lines, prefixes, strict=True)]
    return [e.text for e in group_events(bare, lines, [p.length > 0 for p in prefixes])]
