"""Collective-timeout lines as witnesses: the ranks that complained, and the one that never did.

When one rank of a synchronous job stops, every peer blocked in the collective with
it times out and says so (gloo's ``Timed out waiting ...ms for recv operation``,
the NCCL watchdog's ``[Rank R] Watchdog caught collective operation timeout``).
The stopped rank is not waiting for anyone, so it prints nothing. Once the
complaints of a job settle, the known ranks (from progress) that did not complain
are the culprits, provided most ranks did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from analyzer.detectors import HANG_CAUSES
from analyzer.detectors.book import JobBook
from analyzer.records import Action, FaultClass, Finding, Severity, job_location

DETECTOR_ID = "timeout-witnesses"
TIMEOUT_RULES = frozenset({"gloo-collective-timeout", "nccl-watchdog-timeout"})
"""Rule findings that are a rank's complaint about a collective timing out."""


@dataclass(slots=True)
class _Complaints:
    run: int
    by_rank: dict[int, str] = field(default_factory=dict)
    last_ts: float = 0.0


class WitnessDetector:
    """Collects timeout complaints per job and names the ranks that stayed silent."""

    id = DETECTOR_ID

    def __init__(self, book: JobBook, *, settle_s: float = 3.0, max_silent_fraction: float = 0.25) -> None:
        self.book = book
        self.settle_s = settle_s
        self.max_silent_fraction = max_silent_fraction
        """More silent ranks than this fraction of the job name no culprit (the lines may not all be in)."""
        self._open: dict[str, _Complaints] = {}
        self._reported: set[tuple[str, int]] = set()

    def forget(self, job: str) -> None:
        """Drop the complaints and reports of a job that left the book."""
        self._open.pop(job, None)
        self._reported = {k for k in self._reported if k[0] != job}

    def observe(self, findings: list[Finding]) -> None:
        """Take the complaints among rule findings (those with a job and a rank)."""
        for f in findings:
            if f.rule_id not in TIMEOUT_RULES or f.where.job is None or f.where.rank is None:
                continue
            key = self.book.key_for(f.where.namespace, f.where.job)
            job = self.book.jobs.get(key)
            run = job.run if job is not None else 0
            c = self._open.get(key)
            if c is None or c.run != run:
                c = self._open[key] = _Complaints(run)
            c.by_rank.setdefault(f.where.rank, f.id)
            c.last_ts = max(c.last_ts, f.ts)

    def evaluate(self, now: float) -> list[Finding]:
        """A finding per job whose complaints settled and leave few ranks silent."""
        out: list[Finding] = []
        for name in list(self._open):
            c = self._open[name]
            job = self.book.jobs.get(name)
            known = sorted(r for r in job.ranks if r >= 0) if job is not None else []
            silent = [r for r in known if r not in c.by_rank]
            if now - c.last_ts < self.settle_s and len(silent) != 1:
                continue
            del self._open[name]
            if job is None or (name, c.run) in self._reported:
                continue
            if not silent or len(silent) > max(1, int(self.max_silent_fraction * len(known))):
                continue
            self._reported.add((name, c.run))
            st = job.ranks[silent[0]]
            out.append(Finding(
                id=f"{DETECTOR_ID}:{name}:{c.run}:{c.last_ts:.3f}", ts=max(now, c.last_ts), fault_class=FaultClass.HANG,
                severity=Severity.ERROR, hardware=False, where=job_location(name, node=st.node, rank=silent[0]),
                rule_id=DETECTOR_ID, recommended_action=Action.RESTART_JOB, evidence=tuple(c.by_rank.values())[:64],
                message=(f"job {name}: rank(s) {','.join(map(str, silent[:8]))} never reported the collective "
                         f"timeout that {len(c.by_rank)} of its {len(known)} ranks hit: they are what the others "
                         f"waited for"),
                symptom_of=HANG_CAUSES,
                fields={"culprit_rank": str(silent[0]), "silent_ranks": ",".join(map(str, silent[:64])),
                        "complained_ranks": ",".join(map(str, sorted(c.by_rank)[:64])), "ranks": str(len(known)),
                        "last_step": str(st.last_step)},
            ))
        return out
