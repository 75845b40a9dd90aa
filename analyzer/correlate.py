"""Correlation: fold findings that share a cause into one incident with that cause named.

Pure and deterministic: time comes from the findings, never from a clock. An NCCL
timeout on every rank after an Xid 79 on one node becomes ONE incident rooted at
that node, whichever arrives first.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from dataclasses import replace

from analyzer.incident_index import Draft as _Draft
from analyzer.incident_index import OpenIndex, jobs_seen
from analyzer.records import (
    ACTION_RANK,
    SEVERITY_RANK,
    FaultClass,
    Finding,
    Incident,
    IncidentState,
    Location,
    TimelineEntry,
    job_location,
)

DEFAULT_WINDOW_S = 1200.0
"""How far apart a cause and its symptoms may be: NCCL's default 600 s timeout plus margin."""

JOB_FAILURE_CLASSES = frozenset({FaultClass.NCCL_TIMEOUT, FaultClass.NCCL_ERROR, FaultClass.HANG})
"""Symptoms of one job-wide failure: every rank's timeout, the hang, torchrun's ChildFailedError."""

NARROWING_RULES = {"flight-recorder": 4, "stack-dump": 3, "timeout-witnesses": 3, "hang-detector": 2}
"""Detectors that can name the culprit rank of a job-wide failure, most specific first.

Without a hardware cause, a job-failure incident's root is, in order: the ranks the
Flight Recorder found missing from the collective, then the rank whose Python stack
is outside the collective the others wait in or the rank that never reported the
timeout its peers hit, then the rank whose progress stopped first (hang detector),
then whatever symptom came first.
"""


def narrowing(f: Finding) -> int:
    """How precisely a symptom names the culprit: 0 not at all, 1 the job only, 2+ a rank or node."""
    p = NARROWING_RULES.get(f.rule_id, 0)
    if p and f.where.rank is None and f.where.node is None:
        return 1
    return p


def is_job_failure(f: Finding) -> bool:
    """Whether a symptom belongs to the job-wide failure family (folded into one incident per job)."""
    return f.fault_class in JOB_FAILURE_CLASSES or bool(
        f.symptom_of & {FaultClass.NCCL_TIMEOUT, FaultClass.NCCL_ERROR})


def incident_id_for(finding: Finding) -> str:
    """Stable incident id derived from the finding that opened it."""
    return "inc-" + hashlib.sha256(finding.id.encode()).hexdigest()[:12]


class Correlator:
    """Folds findings into incidents, incrementally and idempotently.

    Open incidents are indexed (`OpenIndex`): a finding is compared with the incidents that share
    its node, job, cause key or a node its job ran on, not with every open incident. ``index=False``
    compares it with every open incident instead: the reference the index is tested and measured against.
    """

    def __init__(self, *, window_s: float = DEFAULT_WINDOW_S, max_incidents: int = 5000,
                 bundle: bool = False, placement_ttl_s: float | None = None, index: bool = True) -> None:
        self.window_s = window_s
        # A job's hold on a node expires when the node has shown nothing of it for this long (time from the
        # records): jobs end and others take the node, and an Xid belongs to the job there now.
        self.placement_ttl_s = window_s if placement_ttl_s is None else placement_ttl_s
        # A log bundle is cut around one failure of one job: there, a cause whose job is unknown may
        # explain any symptom (and vice versa). A live cluster runs many jobs, so it needs a link.
        self.bundle = bundle
        self.max_incidents = max_incidents
        self.indexed = index
        self._latest_ts = 0.0
        self._drafts: dict[str, _Draft] = {}
        self._order = 0
        self._index = OpenIndex()
        self._prune_above = max_incidents
        self._by_finding: dict[str, str] = {}
        self._job_nodes: dict[str, dict[str, float]] = defaultdict(dict)
        self._node_jobs: dict[str, dict[str, float]] = defaultdict(dict)
        self._namespaced: dict[str, set[str]] = {}  # job name -> its ``namespace/job`` keys seen
        self._merges: list[tuple[str, str]] = []

    # -- placement (job <-> node), learned from signals and findings --------

    def observe_placement(self, job: str, node: str, ts: float | None = None) -> None:
        """Record that `job` ran on `node` at `ts` (None: for good, as in a log bundle cut around one failure)."""
        seen = float("inf") if ts is None else ts
        jobs = self._node_jobs[node]
        before = jobs.get(job)
        if before is None or seen > before:
            self._job_nodes[job][node] = seen
            jobs[job] = seen
            if before is None:
                self._index.placed(job, node)
                _, sep, name = job.partition("/")
                if sep:
                    self._namespaced.setdefault(name, set()).add(job)

    def jobs_on(self, node: str, at: float | None = None) -> frozenset[str]:
        """Jobs seen on a node (at `at`: those seen within the placement TTL before it)."""
        jobs = self._node_jobs.get(node, {})
        found = frozenset(jobs) if at is None else frozenset(j for j, seen in jobs.items() if self._fresh(seen, at))
        # A bare name beside ``namespace/name`` on one node is that job seen by a reporter that knows no namespace.
        bare = {j for j in found if "/" not in j and j in self._namespaced}
        if bare:
            found = frozenset(j for j in found if j not in bare or not any(k in found for k in self._namespaced[j]))
        return found

    def _fresh(self, seen: float, at: float) -> bool:
        return seen == float("inf") or at - self.placement_ttl_s <= seen

    # -- folding -------------------------------------------------------------

    def add(self, finding: Finding) -> Incident:
        """Fold one finding; returns the incident it now belongs to."""
        return self._view(self._add(finding))

    def _add(self, finding: Finding) -> _Draft:
        known = self._by_finding.get(finding.id)
        if known is not None:
            return self._live(known)
        finding = self._with_namespace(finding)
        if finding.where.job_key and finding.where.node:
            self.observe_placement(finding.where.job_key, finding.where.node, finding.ts)
        finding = self._with_inferred_job(finding)
        if finding.is_symptom_class:
            draft = self._cause_for(finding) or self._same_symptom(finding)
            if draft is None:
                draft = self._open(finding)
            else:
                self._attach(draft, finding)
        else:
            draft = self._same_cause(finding)
            if draft is None:
                draft = self._adopt_symptoms(finding) or self._open(finding)
            else:
                self._attach(draft, finding)
        return draft

    def add_all(self, findings: Iterable[Finding]) -> list[Incident]:
        """Fold many findings; returns each touched incident once (merged-away ones too), in first-touch order."""
        touched: dict[str, _Draft] = {}
        for f in findings:
            d = self._add(f)
            touched[d.id] = d
            self._latest_ts = max(self._latest_ts, f.ts)
        for old, _new in self._merges:
            touched.setdefault(old, self._drafts[old])
        out = [self._view(d) for d in touched.values()]
        if len(self._drafts) > self._prune_above:
            # Bounded memory: long-quiet finished incidents can no longer attract findings anyway. Live ones
            # stay whatever the times say: finding times come from senders' clocks (bounded by the service's
            # clock at its edge), and no timestamp may make kmend forget an incident it is still healing.
            self.prune(self._latest_ts - 3 * self.window_s)
            # Pruning reads every draft: when most are live, wait until the count grows by half again.
            self._prune_above = max(self.max_incidents, len(self._drafts) * 3 // 2)
        return out

    def restore(self, incident: Incident) -> None:
        """Put back a stored incident with its findings (a restart): they are not correlated again.

        The root is the cause that opened or adopted the incident, or for symptoms only the one
        that names the culprit most precisely (the first of them), as folding chose it.
        """
        causes = [f for f in incident.findings if not f.is_symptom_class and f.fault_class == incident.fault_class]
        root = causes[0] if causes else max(incident.findings, key=narrowing)
        d = _Draft(id=incident.id, root=root, findings=[root, *(f for f in incident.findings if f is not root)],
                   state=incident.state, timeline=list(incident.timeline))
        for f in d.findings:
            self._by_finding[f.id] = d.id
            if f.where.job_key and f.where.node:
                self.observe_placement(f.where.job_key, f.where.node, f.ts)
        self._insert(d)
        self._latest_ts = max(self._latest_ts, d.last_ts)

    def take_merges(self) -> list[tuple[str, str]]:
        """Incidents merged into another since the last call, as (merged id, surviving id)."""
        merges, self._merges = self._merges, []
        return merges

    def set_state(self, incident_id: str, state: IncidentState, ts: float, why: str) -> Incident:
        """Move an incident along its lifecycle (the service does this as healing goes)."""
        draft = self._drafts[incident_id]
        draft.state = state
        draft.timeline.append(TimelineEntry(ts, f"{state.value}: {why}"))
        self._reindex(draft)
        return self._view(draft)

    def resolve_quiet(self, before_ts: float, now: float, *, keep: Collection[str] = (),
                      quiet_s: float | None = None) -> list[Incident]:
        """Resolve open incidents whose newest finding is older than `before_ts`; returns them.

        A fault that stops showing is over, or no longer worth anyone's attention (a notify-only
        incident would otherwise stay open for ever). Incidents being remediated, and those in
        `keep` (a plan still running or waiting for approval), stay open. `now` stamps the timeline.
        """
        why = f"quiet for {quiet_s:.0f} s" if quiet_s is not None else "quiet"
        return [self.set_state(i, IncidentState.RESOLVED, now, why) for i in self.quiet(before_ts) if i not in keep]

    def quiet(self, before_ts: float) -> list[str]:
        """Ids of open incidents (not remediating) whose newest finding is older than `before_ts`."""
        return [d.id for d in self._index.drafts() if d.state is IncidentState.OPEN and d.last_ts < before_ts]

    def incidents(self) -> list[Incident]:
        """All incidents not merged into another, oldest first."""
        live = [d for d in self._drafts.values() if d.merged_into is None]
        return [self._view(d) for d in sorted(live, key=lambda d: d.first_ts)]

    def active(self) -> list[Incident]:
        """Open and remediating incidents, oldest first (what the healer and the node view read)."""
        return [self._view(d) for d in sorted(self._index.drafts(), key=lambda d: (d.first_ts, d.order))]

    def active_counts(self) -> Counter[FaultClass]:
        """How many incidents are open or remediating, by fault class."""
        return Counter(d.root.fault_class for d in self._index.drafts())

    def prune(self, before_ts: float) -> int:
        """Forget resolved or suppressed incidents last updated before `before_ts` (they live on in the store).

        Open and remediating incidents are never forgotten, nor the incidents merged into them.
        Returns how many were forgotten.
        """
        finished = (IncidentState.RESOLVED, IncidentState.SUPPRESSED)
        old = [d for d in self._drafts.values()
               if (live := self._live(d.id)).state in finished and live.last_ts < before_ts]
        for d in old:
            del self._drafts[d.id]
            for f in d.findings:
                if self._by_finding.get(f.id) == d.id:
                    del self._by_finding[f.id]
        for node, jobs in list(self._node_jobs.items()):
            for job, seen in list(jobs.items()):
                if seen < before_ts - self.placement_ttl_s:
                    del jobs[job]
                    self._job_nodes[job].pop(node, None)
        return len(old)

    def get(self, incident_id: str) -> Incident | None:
        """One incident by id (follows merges)."""
        if incident_id not in self._drafts:
            return None
        return self._view(self._live(incident_id))

    # -- internals -----------------------------------------------------------

    def _live(self, incident_id: str) -> _Draft:
        d = self._drafts[incident_id]
        while d.merged_into is not None:
            d = self._drafts[d.merged_into]
        return d

    def _insert(self, d: _Draft) -> None:
        old = self._drafts.get(d.id)
        if old is not None:
            d.order = old.order  # the same id again keeps its place, as a dict key does
            self._index.remove(old)
        else:
            self._order += 1
            d.order = self._order
        self._drafts[d.id] = d
        self._reindex(d)

    def _reindex(self, d: _Draft) -> None:
        """Put a draft in the index under its current root, or take it out once merged or finished."""
        d.view = None
        self._index.remove(d)
        if d.merged_into is not None or d.state not in (IncidentState.OPEN, IncidentState.REMEDIATING):
            return
        if d.symptom_only:
            self._index.add_symptom(d)
        else:
            self._index.add_cause(d, self._cause_key(d.root), jobs_seen(self._node_jobs, d.root.where.node))

    def _with_namespace(self, f: Finding) -> Finding:
        # A reporter that knows no namespace (an older agent, a hook outside any pod) names the job of
        # that name when exactly one namespace has it.
        # A bare name that was itself seen (its own reporters never name a namespace) stays as it is.
        w = f.where
        if w.job is None or w.namespace or w.job in self._job_nodes:
            return f
        keys = self._namespaced.get(w.job)
        if keys is None or len(keys) != 1:
            return f
        return replace(f, where=replace(w, namespace=next(iter(keys)).partition("/")[0]))

    def _with_inferred_job(self, f: Finding) -> Finding:
        # Kernel lines name no job; if exactly one job runs on the node, it is that job's.
        if f.where.job is None and f.where.node:
            jobs = self.jobs_on(f.where.node, at=f.ts)
            if len(jobs) == 1:
                known = job_location(next(iter(jobs)))
                return replace(f, where=replace(f.where, job=known.job, namespace=known.namespace))
        return f

    def _open_drafts(self) -> Iterable[_Draft]:
        return (
            d for d in self._drafts.values()
            if d.merged_into is None and d.state in (IncidentState.OPEN, IncidentState.REMEDIATING)
        )

    def _near(self, d: _Draft, ts: float) -> bool:
        return d.first_ts - self.window_s <= ts <= d.last_ts + self.window_s

    def _related(self, cause: Finding, symptom: Finding) -> bool:
        """Whether a cause on some node can explain a symptom seen by some rank."""
        if cause.where.node and cause.where.node == symptom.where.node:
            return True
        job = symptom.where.job_key
        if job is not None:
            if cause.where.job_key == job:
                return True
            seen = self._job_nodes.get(job, {}).get(cause.where.node or "")
            if seen is not None and self._fresh(seen, max(cause.ts, symptom.ts)):
                return True
        return self.bundle and (job is None or cause.where.job_key is None)

    def _explains_some(self, cause: Finding, d: _Draft) -> bool:
        """``any(self._related(cause, s) for s in d.findings)`` from the draft's member summary, in O(jobs)."""
        w = cause.where
        if (w.node and w.node in d.member_nodes) or (w.job_key is not None and w.job_key in d.member_jobs):
            return True
        for job, earliest in d.member_jobs.items():
            seen = self._job_nodes.get(job, {}).get(w.node or "")
            # Freshness is judged at max(cause time, member time): the earliest member is the best chance.
            if seen is not None and self._fresh(seen, max(cause.ts, earliest)):
                return True
        return self.bundle and (d.member_nojob or w.job_key is None)

    def _cause_for(self, symptom: Finding) -> _Draft | None:
        best: _Draft | None = None
        if not self.indexed:
            candidates: Iterable[_Draft] = self._open_drafts()
        elif self.bundle:
            candidates = self._index.causes.values()
        else:
            candidates = self._index.causes_for(symptom, symptom.symptom_of)
        ts, w, classes = symptom.ts, self.window_s, symptom.symptom_of
        for d in candidates:
            # The cheap tests first: a job's bucket may hold many causes on its nodes.
            if not d.first_ts - w <= ts <= d.last_ts + w:
                continue
            if best is not None and (d.first_ts, d.order) >= (best.first_ts, best.order):
                continue
            r = d.root
            if r.is_symptom_class or r.fault_class not in classes or not self._related(r, symptom):
                continue
            best = d
        return best

    def _same_symptom(self, f: Finding) -> _Draft | None:
        best = self._same_symptom_of(f)
        w = f.where
        if best is None and w.namespace and w.job and w.node in self._job_nodes.get(w.job, {}):
            # Opened under the job's bare name on this node before its namespace was learnt: the same incident.
            best = self._same_symptom_of(replace(f, where=replace(w, namespace=None)))
        return best

    def _same_symptom_of(self, f: Finding) -> _Draft | None:
        best: _Draft | None = None
        for d in self._open_drafts() if not self.indexed else self._index.same_symptom(f):
            if not d.symptom_only or not self._near(d, f.ts) or (best is not None and best.order < d.order):
                continue
            same_kind = d.root.fault_class == f.fault_class or (
                is_job_failure(f) and is_job_failure(d.root) and f.where.job_key is not None)
            if not same_kind:
                continue
            if (f.where.job_key is not None and f.where.job_key == d.root.where.job_key) or (
                    f.where.job_key is None and d.root.where.job_key is None and f.where.node == d.root.where.node):
                best = d
        return best

    def _cause_key(self, f: Finding) -> tuple[object, ...]:
        if f.hardware:
            return (f.fault_class, f.where.node, f.where.pci or f.where.gpu, f.where.port)
        # Application faults group by job (fleet-wide Xid 13 from one job is one incident).
        return (f.fault_class, f.where.job_key or f.where.node)

    def _same_cause(self, f: Finding) -> _Draft | None:
        key = self._cause_key(f)
        best: _Draft | None = None
        for d in self._open_drafts() if not self.indexed else self._index.same_cause(key):
            if best is not None and best.order < d.order:
                continue
            if not d.symptom_only and self._cause_key(d.root) == key and self._near(d, f.ts):
                best = d
        return best

    def _adopt_symptoms(self, cause: Finding) -> _Draft | None:
        """A cause arriving after its symptoms takes over their incident(s) as root."""
        if not self.indexed:
            candidates: Iterable[_Draft] = self._open_drafts()
        elif self.bundle:
            candidates = self._index.symptoms.values()
        else:
            candidates = self._index.adoptable(cause, jobs_seen(self._node_jobs, cause.where.node))
        orphans = [
            d for d in candidates
            if d.symptom_only and cause.fault_class in d.root.symptom_of
            and self._near(d, cause.ts) and (
                self._explains_some(cause, d) if self.indexed else any(self._related(cause, s) for s in d.findings))
        ]
        if not orphans:
            return None
        orphans.sort(key=lambda d: (d.first_ts, d.order))
        keep = orphans[0]
        for other in orphans[1:]:
            keep.findings.extend(other.findings)
            for s in other.findings:
                keep.note(s)
                self._by_finding[s.id] = keep.id
            other.merged_into = keep.id
            other.state = IncidentState.SUPPRESSED
            other.timeline.append(TimelineEntry(cause.ts, f"merged into {keep.id}"))
            self._reindex(other)
            self._merges.append((other.id, keep.id))
        keep.root = cause
        keep.findings.insert(0, cause)
        keep.note(cause)
        self._by_finding[cause.id] = keep.id
        why = f"root cause found: {cause.rule_id} on {cause.where.node}"
        keep.timeline.append(TimelineEntry(cause.ts, why))
        self._reindex(keep)
        return keep

    def _open(self, f: Finding) -> _Draft:
        d = _Draft(id=incident_id_for(f), root=f, findings=[f])
        d.timeline.append(TimelineEntry(f.ts, f"opened by {f.rule_id} on {f.where.node}"))
        self._insert(d)
        self._by_finding[f.id] = d.id
        return d

    def _attach(self, d: _Draft, f: Finding) -> None:
        d.findings.append(f)
        d.note(f)
        d.view = None
        self._by_finding[f.id] = d.id
        self._index.add_member(d, f)
        if d.symptom_only and narrowing(f) > narrowing(d.root):
            # A detector that names the culprit becomes the root of a job-wide failure.
            d.findings.remove(f)
            d.findings.insert(0, f)
            d.root = f
            who = f"rank {f.where.rank} on {f.where.node}" if f.where.rank is not None else f"{f.where.node}"
            d.timeline.append(TimelineEntry(f.ts, f"root cause narrowed by {f.rule_id}: {who}"))
            self._reindex(d)

    def _view(self, d: _Draft) -> Incident:
        if d.view is not None:
            return d.view
        root = d.root
        jobs = {k for f in d.findings if (k := f.where.job_key)}
        causes = [f for f in d.findings if not f.is_symptom_class] or [root]
        action = max((f.recommended_action for f in causes), key=lambda a: ACTION_RANK[a])
        severity = max((f.severity for f in d.findings), key=lambda s: SEVERITY_RANK[s])
        rc: Location = root.where
        if rc.job is None and len(jobs) == 1:
            known = job_location(next(iter(jobs)))
            rc = replace(rc, job=known.job, namespace=known.namespace)
        if d.symptom_only:
            rc = self._symptom_root(d)
        elif not root.hardware and len({f.where.node for f in causes}) > 1:
            # The same application fault on many nodes is the job's, not any one node's.
            rc = Location(job=rc.job, namespace=rc.namespace)
        d.view = Incident(
            id=d.id, fault_class=root.fault_class, severity=severity, hardware=root.hardware,
            recommended_action=action, root_cause=rc, opened_at=d.first_ts, updated_at=d.last_ts,
            findings=tuple(d.findings), jobs=frozenset(jobs), state=d.state,
            timeline=tuple(d.timeline),
        )
        return d.view

    @staticmethod
    def _symptom_root(d: _Draft) -> Location:
        # Without a hardware cause, name only what all symptoms agree on (the job),
        # unless a detector (flight recorder, hang) named the culprit rank or node.
        if narrowing(d.root) >= 2:
            return d.root.where
        nodes = {f.where.node for f in d.findings}
        root = d.root.where
        return Location(
            node=root.node if len(nodes) == 1 else None, job=root.job, namespace=root.namespace,
            rank=root.rank if len(d.findings) == 1 else None,
        )


def fault_classes(incidents: Iterable[Incident]) -> list[FaultClass]:
    """Fault classes of incidents, in order (handy for tests and summaries)."""
    return [i.fault_class for i in incidents]
