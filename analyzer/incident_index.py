"""Open incidents indexed by what a new finding can match them on, so folding costs O(matches), not O(open).

The correlator's rules say which open incident a finding joins: the cause of a symptom on the
same node or job (or a node the job ran on), the symptom incident of the same job, the incident
with the same cause key, the symptom incidents a late cause adopts. Each rule reads one of these
buckets; every bucket holds a superset of what the rule accepts, and the correlator applies the
rule itself to the few drafts it gets back. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain

from analyzer.records import FaultClass, Finding, Incident, IncidentState, TimelineEntry

Bucket = dict[str, "Draft"]
"""Drafts by id; a dict keeps insertion order and makes adding twice harmless."""


@dataclass(slots=True, eq=False)
class Draft:
    """An incident while it is being folded (mutable; `Incident` is its frozen view)."""

    id: str
    """Incident id."""
    root: Finding
    """The finding that names the root cause."""
    findings: list[Finding]
    """Member findings, root first."""
    order: int = 0
    """Position among the correlator's drafts: ties between equal candidates go to the older draft."""
    state: IncidentState = IncidentState.OPEN
    """Lifecycle state."""
    timeline: list[TimelineEntry] = field(default_factory=list)
    """What happened, in order."""
    merged_into: str | None = None
    """Id of the incident this one was merged into, if any."""
    first_ts: float = float("inf")
    """Time of the earliest member."""
    last_ts: float = float("-inf")
    """Time of the latest member."""
    member_nodes: set[str] = field(default_factory=set)
    """Nodes named by members (a late cause on one of them can adopt this incident)."""
    member_jobs: dict[str, float] = field(default_factory=dict)
    """Jobs named by members, with the earliest member time of each."""
    member_nojob: bool = False
    """Whether some member names no job."""
    view: Incident | None = None
    """The frozen view, cached until the draft changes."""
    keys: list[tuple[dict[Hashable, Bucket], Hashable]] = field(default_factory=list)
    """The index buckets this draft is in (to take it out again)."""

    def __post_init__(self) -> None:
        for f in self.findings:
            self.note(f)

    def note(self, f: Finding) -> None:
        """Account for a member's time, node and job."""
        self.first_ts = min(self.first_ts, f.ts)
        self.last_ts = max(self.last_ts, f.ts)
        w = f.where
        if w.node:
            self.member_nodes.add(w.node)
        if w.job_key is None:
            self.member_nojob = True
        elif (seen := self.member_jobs.get(w.job_key)) is None or f.ts < seen:
            self.member_jobs[w.job_key] = f.ts

    @property
    def symptom_only(self) -> bool:
        """Whether no cause has been found (the root is a symptom)."""
        return self.root.is_symptom_class


class OpenIndex:
    """Buckets of open, unmerged drafts. The correlator adds a draft when it opens or changes root and
    removes it when it is merged, resolved or suppressed."""

    def __init__(self) -> None:
        self.causes: Bucket = {}
        # Drafts rooted at a cause, by (class, node), (class, job) and cause key. A job's bucket also
        # holds the causes on every node the job was seen on (the placement may be stale: the caller checks).
        self._cause_node: dict[Hashable, Bucket] = {}
        self._cause_job: dict[Hashable, Bucket] = {}
        self._cause_key: dict[Hashable, Bucket] = {}
        self._cause_on: dict[Hashable, Bucket] = {}
        self.symptoms: Bucket = {}
        # Symptom-only drafts by their root's job (or node when it names no job), and by every member's
        # node and job: a late cause adopts the incidents of symptoms it can explain.
        self._symptom_root: dict[Hashable, Bucket] = {}
        self._member_node: dict[Hashable, Bucket] = {}
        self._member_job: dict[Hashable, Bucket] = {}

    def __len__(self) -> int:
        return len(self.causes) + len(self.symptoms)

    def drafts(self) -> Iterable[Draft]:
        """Every indexed (open, unmerged) draft."""
        yield from self.causes.values()
        yield from self.symptoms.values()

    @staticmethod
    def _put(d: Draft, idx: dict[Hashable, Bucket], key: Hashable) -> None:
        bucket = idx.setdefault(key, {})
        if d.id not in bucket:
            bucket[d.id] = d
            d.keys.append((idx, key))

    def add_cause(self, d: Draft, cause_key: Hashable, jobs_on_node: Iterable[str]) -> None:
        """Index a draft rooted at a cause; `jobs_on_node`: jobs seen on its root's node."""
        self.causes[d.id] = d
        fc, w = d.root.fault_class, d.root.where
        node = w.node or ""
        self._put(d, self._cause_on, node)
        self._put(d, self._cause_node, (fc, node))
        if w.job_key is not None:
            self._put(d, self._cause_job, (fc, w.job_key))
        for job in jobs_on_node:
            self._put(d, self._cause_job, (fc, job))
        self._put(d, self._cause_key, cause_key)

    def add_symptom(self, d: Draft) -> None:
        """Index a symptom-only draft with every member seen so far."""
        self.symptoms[d.id] = d
        w = d.root.where
        self._put(d, self._symptom_root, ("job", w.job_key) if w.job_key is not None else ("node", w.node))
        for node in d.member_nodes:
            self._put(d, self._member_node, node)
        for job in d.member_jobs:
            self._put(d, self._member_job, job)

    def add_member(self, d: Draft, f: Finding) -> None:
        """A symptom-only draft gained a member: index it under that member's node and job too."""
        if d.id in self.symptoms:
            if f.where.node:
                self._put(d, self._member_node, f.where.node)
            if f.where.job_key is not None:
                self._put(d, self._member_job, f.where.job_key)

    def remove(self, d: Draft) -> None:
        """Take a draft out of every bucket."""
        self.causes.pop(d.id, None)
        self.symptoms.pop(d.id, None)
        for idx, key in d.keys:
            bucket = idx.get(key)
            if bucket is not None and bucket.pop(d.id, None) is not None and not bucket:
                del idx[key]
        d.keys.clear()

    def placed(self, job: str, node: str) -> None:
        """A job was seen on a node for the first time: the causes there may explain its symptoms."""
        for d in list(self._cause_on.get(node, {}).values()):
            self._put(d, self._cause_job, (d.root.fault_class, job))

    # -- candidates: supersets of what each folding rule accepts ------------------------------------

    def causes_for(self, symptom: Finding, classes: Collection[FaultClass]) -> Iterable[Draft]:
        """Cause drafts of these classes on the symptom's node, of its job, or on a node its job ran on.

        A draft may come twice (its node's bucket and its job's): the caller picks a minimum, so that is harmless.
        """
        w = symptom.where
        buckets = []
        for fc in classes:
            if w.node and (b := self._cause_node.get((fc, w.node))):
                buckets.append(b.values())
            if w.job_key is not None and (b := self._cause_job.get((fc, w.job_key))):
                buckets.append(b.values())
        return chain.from_iterable(buckets)

    def same_cause(self, cause_key: Hashable) -> Iterable[Draft]:
        """Cause drafts with this cause key."""
        return self._cause_key.get(cause_key, {}).values()

    def same_symptom(self, f: Finding) -> Iterable[Draft]:
        """Symptom drafts rooted in the finding's job (or, when it names none, on its node)."""
        w = f.where
        return self._symptom_root.get(("job", w.job_key) if w.job_key is not None else ("node", w.node), {}).values()

    def adoptable(self, cause: Finding, jobs_on_node: Iterable[str]) -> Iterable[Draft]:
        """Symptom drafts with a member on the cause's node, of its job, or of a job seen on its node."""
        out: Bucket = {}
        w = cause.where
        if w.node:
            out.update(self._member_node.get(w.node, {}))
        if w.job_key is not None:
            out.update(self._member_job.get(w.job_key, {}))
        for job in jobs_on_node:
            out.update(self._member_job.get(job, {}))
        return out.values()


def jobs_seen(node_jobs: Mapping[str, Mapping[str, float]], node: str | None) -> Iterable[str]:
    """Jobs recorded on a node (any age: candidates are checked for freshness by the caller)."""
    return node_jobs.get(node or "", {}).keys()
