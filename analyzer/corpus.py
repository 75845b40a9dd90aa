"""The real-log corpus: labelled excerpts from public threads, their split, and the score.

Each excerpt is verbatim lines a public bug thread posted, labelled with what the thread
concluded (fault class, hardware or application, the acceptable actions). Excerpts are
split by thread with a hash nobody chooses, so rules are written from one half (``dev``)
and judged on the other (``heldout``); a drop between the halves means over-fitting.
Scoring is pure: the caller runs the excerpts and hands over the incidents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from analyzer.records import ACTION_RANK, SEVERITY_RANK, Action, FaultClass, Incident

Split = Literal["dev", "heldout"]

QUARANTINE_ACTIONS = frozenset({Action.REPLACE_NODE, Action.REBOOT_NODE})
"""Actions that take a node out of service: wrong for a fault in the application."""


def split_of(thread: str) -> Split:
    """The half a thread's excerpts belong to, decided by its hash so nobody chooses it."""
    return "dev" if hashlib.sha256(thread.encode()).digest()[0] % 2 == 0 else "heldout"


class CorpusError(ValueError):
    """A corpus file is invalid; the message names the file, entry id and field."""


class _Culprit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str | None = None
    gpu: int | str | None = None
    pci: str | None = None
    rank: int | None = None


class _Expect(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    fault_class: FaultClass | Literal["none"]
    hardware: bool | None = None
    actions: tuple[Action, ...] = ()
    culprit: _Culprit | None = None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    url: str
    thread: str
    source: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    text: str = Field(min_length=1)
    expect: _Expect
    why: str = Field(min_length=10)

    @field_validator("url", "thread")
    @classmethod
    def _public_address(cls, v: str) -> str:
        if not v.startswith("https://"):
            raise ValueError("must be an https:// address of a public thread")
        return v


@dataclass(frozen=True, slots=True)
class CorpusEntry:
    """One labelled excerpt."""

    id: str
    """Unique slug."""
    file: str
    """Corpus file it came from."""
    url: str
    """Where the lines were posted."""
    thread: str
    """The thread: the split key."""
    source: str
    """How the lines arrive (kernel, container, syslog, nvidia-smi, ...)."""
    text: str
    """The verbatim lines."""
    fault_class: FaultClass | None
    """Expected fault class of the top incident; None for a benign excerpt."""
    hardware: bool | None
    """Expected hardware/application call; None when the thread does not say."""
    actions: frozenset[Action]
    """Acceptable recommended actions."""
    culprit: Mapping[str, Any]
    """What the thread names as the culprit (node, gpu, pci, rank), for the reader."""
    why: str
    """The reason for the label, from the thread."""

    @property
    def split(self) -> Split:
        """The half this excerpt belongs to."""
        return split_of(self.thread)

    @property
    def benign(self) -> bool:
        """Whether the excerpt must produce nothing."""
        return self.fault_class is None


def parse_entries(doc: object, file: str) -> list[CorpusEntry]:
    """Entries of one corpus document (the YAML already parsed); CorpusError names the problem."""
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise CorpusError(f"{file}: expected a mapping with an 'entries' list")
    out: list[CorpusEntry] = []
    for n, raw in enumerate(doc["entries"]):
        ident = raw.get("id") if isinstance(raw, dict) else None
        try:
            e = _Entry.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise CorpusError(f"{file}: entry {ident or n!r}: field {loc!r}: {err['msg']}") from exc
        fault = None if e.expect.fault_class == "none" else FaultClass(e.expect.fault_class)
        if fault is not None and not e.expect.actions:
            raise CorpusError(f"{file}: entry {e.id!r}: field 'expect.actions': a fault needs its acceptable actions")
        if fault is None and (e.expect.hardware is not None or e.expect.actions):
            raise CorpusError(f"{file}: entry {e.id!r}: field 'expect': a benign excerpt has no hardware or actions")
        culprit = e.expect.culprit.model_dump(exclude_none=True) if e.expect.culprit else {}
        out.append(CorpusEntry(
            id=e.id, file=file, url=e.url, thread=e.thread, source=e.source, text=e.text, fault_class=fault,
            hardware=e.expect.hardware, actions=frozenset(e.expect.actions), culprit=culprit, why=e.why,
        ))
    return out


def check_unique(entries: Iterable[CorpusEntry]) -> None:
    """Raise CorpusError when two entries share an id."""
    seen: dict[str, str] = {}
    for e in entries:
        if e.id in seen:
            raise CorpusError(f"{e.file}: entry {e.id!r}: field 'id': also used in {seen[e.id]}")
        seen[e.id] = e.file


def top_incident(incidents: Sequence[Incident]) -> Incident | None:
    """The incident an operator acts on first: most severe, then most disruptive, then earliest."""
    if not incidents:
        return None
    return max(incidents, key=lambda i: (SEVERITY_RANK[i.severity], ACTION_RANK[i.recommended_action],
                                         -i.opened_at))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How kmend did on one excerpt."""

    entry: CorpusEntry
    """The excerpt."""
    fault_class: FaultClass | None
    """Class of the top incident (None: no incident)."""
    hardware: bool | None
    """Hardware call of the top incident."""
    action: Action | None
    """Recommended action of the top incident."""
    rule: str | None
    """Rule or detector of the top incident's root finding."""
    quarantine: bool
    """Whether any incident takes a node out of service."""

    @property
    def class_ok(self) -> bool:
        """Top incident's class is the expected one (for a benign excerpt: no incident)."""
        return self.fault_class == self.entry.fault_class

    @property
    def hardware_ok(self) -> bool:
        """Hardware/application call matches (only asked where the label says)."""
        return self.fault_class is not None and self.hardware == self.entry.hardware

    @property
    def action_ok(self) -> bool:
        """Recommended action is in the acceptable set."""
        return self.action is not None and self.action in self.entry.actions

    @property
    def benign_alarm(self) -> bool:
        """A benign excerpt produced an incident."""
        return self.entry.benign and self.fault_class is not None

    @property
    def app_quarantine(self) -> bool:
        """An application fault took a node out of service."""
        return self.entry.hardware is False and self.quarantine

    @property
    def ok(self) -> bool:
        """Nothing wrong with this excerpt's diagnosis."""
        if self.entry.benign:
            return not self.benign_alarm
        hw = self.entry.hardware is None or self.hardware_ok
        return self.class_ok and hw and self.action_ok and not self.app_quarantine


def outcome(entry: CorpusEntry, incidents: Sequence[Incident]) -> Outcome:
    """Judge one excerpt's incidents."""
    top = top_incident(incidents)
    return Outcome(
        entry=entry, fault_class=top.fault_class if top else None, hardware=top.hardware if top else None,
        action=top.recommended_action if top else None, rule=top.root_finding.rule_id if top else None,
        quarantine=any(i.recommended_action in QUARANTINE_ACTIONS for i in incidents),
    )


def _ratio(hits: int, total: int) -> float | None:
    return round(hits / total, 3) if total else None


def score(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Accuracy figures and misses of one half (or all) of the corpus."""
    faults = [o for o in outcomes if not o.entry.benign]
    labelled_hw = [o for o in faults if o.entry.hardware is not None]
    benign = [o for o in outcomes if o.entry.benign]
    return {
        "excerpts": len(outcomes), "faults": len(faults), "benign": len(benign),
        "threads": len({o.entry.thread for o in outcomes}),
        "class_accuracy": _ratio(sum(o.class_ok for o in faults), len(faults)),
        "hardware_accuracy": _ratio(sum(o.hardware_ok for o in labelled_hw), len(labelled_hw)),
        "action_accuracy": _ratio(sum(o.action_ok for o in faults), len(faults)),
        "no_incident": sum(o.fault_class is None for o in faults),
        "benign_alarms": sum(o.benign_alarm for o in benign),
        "app_quarantines": sum(o.app_quarantine for o in outcomes),
        "by_class": by_class(faults),
        "misses": [_miss(o) for o in outcomes if not o.ok],
    }


def by_class(faults: Sequence[Outcome]) -> dict[str, dict[str, int]]:
    """Per expected fault class: how many excerpts, how many got that class, how many got no incident, and of
    those labelled hardware or application, how many got that call.

    Counts only, so a held-out family can be told weak without reading its excerpts.
    """
    out: dict[str, dict[str, int]] = {}
    for o in faults:
        if o.entry.fault_class is None:
            continue
        row = out.setdefault(o.entry.fault_class.value,
                             {"faults": 0, "class_ok": 0, "no_incident": 0, "hardware_labelled": 0,
                              "hardware_ok": 0})
        row["faults"] += 1
        row["class_ok"] += o.class_ok
        row["no_incident"] += o.fault_class is None
        if o.entry.hardware is not None:
            row["hardware_labelled"] += 1
            row["hardware_ok"] += o.hardware_ok
    return dict(sorted(out.items()))


def _miss(o: Outcome) -> dict[str, Any]:
    e = o.entry
    return {
        "id": e.id, "url": e.url,
        "expected": {"fault_class": e.fault_class.value if e.fault_class else "none", "hardware": e.hardware,
                     "actions": sorted(a.value for a in e.actions)},
        "got": {"fault_class": o.fault_class.value if o.fault_class else None, "hardware": o.hardware,
                "action": o.action.value if o.action else None, "rule": o.rule},
    }
