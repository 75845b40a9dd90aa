"""PyTorch Flight Recorder dumps: which ranks never joined the collective that hung.

With ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (or
``TORCH_FR_BUFFER_SIZE``) > 0, each rank writes a pickle to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default
``~/.cache/torch/comm_lib_trace_rank_<rank>``, ``nccl_trace_rank_`` in older releases)
when a collective times out. The pickle is a dict: ``version``, ``pg_config``
(``{pg_name: {"name", "desc", "ranks": "[0, 1, ...]"}}``), ``pg_status``
(``{pg_id: {"last_enqueued_collective", "last_started_collective",
"last_completed_collective"}}``) and ``entries``, a ring buffer of collectives with
``process_group`` ``(pg_name, desc)``, ``collective_seq_id``, ``profiling_name``,
``state`` (``scheduled``/``started``/``completed``) and ``retired``.

The lowest collective sequence id not completed on every rank is where the job
stopped (gloo also retires the collective that failed, so there it is the last one
the dumping ranks enqueued); the ranks whose last enqueued collective is below it never joined, and
they are the culprits. Dumps are untrusted input: they are read with an unpickler
that builds only plain containers and refuses every class, so a crafted dump
cannot run code.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from analyzer.detectors import HANG_CAUSES
from analyzer.records import Action, FaultClass, Finding, Severity, job_location

DETECTOR_ID = "flight-recorder"
MAX_DUMP_BYTES = 64 * 1024 * 1024
"""Larger dumps are refused (the default 2,000-entry buffer is a few MB)."""


class DumpError(ValueError):
    """A dump is not a Flight Recorder pickle we can read safely; the message names the field."""


MAX_ENTRIES = 100_000
"""Entries a dump may hold (the ring buffer is 2,000 by default; 20,000 is a generous setting)."""
MAX_GROUPS = 10_000
"""Process groups a dump may configure."""
MAX_RANKS_TEXT = 2 * 1024 * 1024
"""Characters of one group's ``ranks`` list (a million ranks fit)."""
MAX_NAME = 1024
"""Characters of a group name, description or profiling name."""
_RANKS = re.compile(r"\s*\[\s*(?:\d+\s*(?:,\s*\d+\s*)*,?\s*)?\]\s*")
_STATES = frozenset({"scheduled", "started", "completed"})


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, bools and None; refuses every global."""

    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"refused to load {module}.{name}: Flight Recorder dumps hold only plain values")


@dataclass(frozen=True, slots=True)
class Entry:
    """The fields of one ring-buffer entry that the analysis reads, checked."""

    pg: tuple[str, str]
    """``process_group``: (name, description)."""
    seq: int
    """``collective_seq_id`` (> 0; 0 means a point-to-point or unsequenced entry, which is skipped)."""
    op: str
    """``profiling_name`` (``nccl:all_reduce``)."""
    completed: bool
    """State ``completed``, or retired (gloo leaves ``scheduled`` and retires a finished entry)."""


@dataclass(frozen=True, slots=True)
class Dump:
    """One rank's dump, reduced to what the analysis reads; every field checked at the edge."""

    entries: tuple[Entry, ...]
    """Collective entries (point-to-point ones dropped)."""
    groups: Mapping[str, tuple[str, tuple[int, ...]]]
    """``pg_config``: group name -> (description, ranks)."""

    def ranks_of(self, pg: str, desc: str) -> tuple[int, ...]:
        """Ranks of a process group, found by name, else by a unique description, else the only group."""
        got = self.groups.get(pg)
        if got is None:
            same = [g for g in self.groups.values() if g[0] == desc]
            got = same[0] if len(same) == 1 else (next(iter(self.groups.values())) if len(self.groups) == 1
                                                   else None)
        return got[1] if got is not None else ()


def _text(value: object, field: str, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise DumpError(f"{field}: expected text, got {type(value).__name__}")
    if len(value) > MAX_NAME:
        raise DumpError(f"{field}: longer than {MAX_NAME} characters")
    return value


def _int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DumpError(f"{field}: expected an integer, got {type(value).__name__} {str(value)[:40]!r}")
    if not 0 <= value < 2**63:
        raise DumpError(f"{field}: {value} is out of range")
    return value


def _entry(raw: object, i: int) -> Entry | None:
    at = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise DumpError(f"{at}: expected a mapping, got {type(raw).__name__}")
    p2p = raw.get("is_p2p", False)
    if not isinstance(p2p, bool) and p2p is not None:
        raise DumpError(f"{at}.is_p2p: expected a bool, got {type(p2p).__name__}")
    seq = _int(raw.get("collective_seq_id", 0) or 0, f"{at}.collective_seq_id")
    state = raw.get("state")
    if state is not None and (not isinstance(state, str) or state not in _STATES):
        raise DumpError(f"{at}.state: expected one of {sorted(_STATES)}, got {str(state)[:40]!r}")
    retired = raw.get("retired", False)
    if not isinstance(retired, bool) and retired is not None:
        raise DumpError(f"{at}.retired: expected a bool, got {type(retired).__name__}")
    pg = raw.get("process_group") or ("", "")
    if not isinstance(pg, tuple | list) or not 1 <= len(pg) <= 2:
        raise DumpError(f"{at}.process_group: expected (name, description)")
    name = _text(pg[0], f"{at}.process_group[0]", required=True)
    desc = _text(pg[1], f"{at}.process_group[1]", required=True) if len(pg) > 1 else ""
    op = _text(raw.get("profiling_name"), f"{at}.profiling_name")
    if p2p or not seq:
        return None
    return Entry(pg=(name, desc), seq=seq, op=op, completed=state == "completed" or retired is True)


def _groups(raw: object) -> dict[str, tuple[str, tuple[int, ...]]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise DumpError(f"pg_config: expected a mapping, got {type(raw).__name__}")
    if len(raw) > MAX_GROUPS:
        raise DumpError(f"pg_config: {len(raw)} process groups, more than {MAX_GROUPS}")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, cfg in raw.items():
        name = _text(key, "pg_config key", required=True)
        at = f"pg_config[{name[:64]!r}]"
        if not isinstance(cfg, dict):
            raise DumpError(f"{at}: expected a mapping, got {type(cfg).__name__}")
        ranks = cfg.get("ranks", "[]")
        if isinstance(ranks, list | tuple):
            if len(ranks) > MAX_RANKS_TEXT // 2:
                raise DumpError(f"{at}.ranks: more than {MAX_RANKS_TEXT // 2} ranks")
            parsed = tuple(_int(r, f"{at}.ranks") for r in ranks)
        elif isinstance(ranks, str):
            # PyTorch writes the list as its text ("[0, 1, 2]"): read digits, never evaluate.
            if len(ranks) > MAX_RANKS_TEXT or not _RANKS.fullmatch(ranks):
                raise DumpError(f"{at}.ranks: expected a list of ranks such as '[0, 1, 2]'")
            parsed = tuple(int(d) for d in re.findall(r"\d+", ranks))
        else:
            raise DumpError(f"{at}.ranks: expected a list of ranks, got {type(ranks).__name__}")
        out[name] = (_text(cfg.get("desc"), f"{at}.desc"), parsed)
    return out


def load_dump(data: bytes) -> Dump:
    """Parse one rank's dump safely and check every field the analysis reads.

    Bounded: at most MAX_DUMP_BYTES of pickle and MAX_ENTRIES entries, each read once here,
    so a dump that unpickles into millions of references to one entry is refused before any
    analysis sees it.
    """
    if len(data) > MAX_DUMP_BYTES:
        raise DumpError(f"dump of {len(data)} bytes is larger than {MAX_DUMP_BYTES}")
    try:
        doc = _PlainUnpickler(io.BytesIO(data)).load()
    except DumpError:
        raise
    except Exception as exc:  # any malformed pickle: truncated, wrong opcode, bad protocol
        raise DumpError(f"not a readable pickle: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise DumpError("entries: not a Flight Recorder dump: no 'entries' list")
    raw_entries = doc["entries"]
    if len(raw_entries) > MAX_ENTRIES:
        raise DumpError(f"entries: {len(raw_entries)} entries, more than {MAX_ENTRIES}")
    entries = tuple(e for i, raw in enumerate(raw_entries) if (e := _entry(raw, i)) is not None)
    return Dump(entries=entries, groups=_groups(doc.get("pg_config")))


@dataclass(frozen=True, slots=True)
class RankDump:
    """One rank's dump with where it came from."""

    rank: int
    """Global rank that wrote it."""
    node: str
    """Node it came from."""
    doc: Dump
    """The checked dump."""
    source: str = ""
    """Evidence id (file or upload id)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where a process group stopped and who is missing."""

    pg: str
    """Process group name (and description)."""
    seq: int
    """Lowest collective sequence id not completed on every rank."""
    op: str
    """Its profiling name (``nccl:all_reduce``)."""
    expected: tuple[int, ...]
    """Ranks of the process group."""
    missing: tuple[int, ...]
    """Ranks that dumped but never enqueued `seq`."""
    silent: tuple[int, ...]
    """Ranks of the group that wrote no dump (dead, hung, or their node is gone)."""

    @property
    def culprits(self) -> tuple[int, ...]:
        """Missing ranks; failing those, the silent ones when every rank that dumped joined."""
        return self.missing or self.silent


def analyze(dumps: Iterable[RankDump]) -> list[Verdict]:
    """Verdicts for the process groups whose collectives did not all complete, lowest seq first."""
    per_pg: dict[tuple[str, str], dict[int, list[Entry]]] = {}
    expected: dict[tuple[str, str], set[int]] = {}
    dumped: set[int] = set()
    for d in dumps:
        dumped.add(d.rank)
        for e in d.doc.entries:
            per_pg.setdefault(e.pg, {}).setdefault(d.rank, []).append(e)
            if e.pg not in expected:
                expected[e.pg] = set(d.doc.ranks_of(*e.pg))
    out: list[Verdict] = []
    for key, by_rank in per_pg.items():
        members = expected[key] or set(by_rank)
        done = {r: max((e.seq for e in es if e.completed), default=0) for r, es in by_rank.items()}
        enq = {r: max(e.seq for e in es) for r, es in by_rank.items()}
        pending = [e.seq for es in by_rank.values() for e in es if not e.completed]
        if pending:
            seq = min(pending)
        else:
            # Gloo retires a collective that failed too; the dumps were written because one did,
            # so the last collective the dumping ranks enqueued is the one that failed.
            seq = max(enq.values())
            if all(v == seq for v in enq.values()) and members <= dumped:
                continue
        # A rank whose last enqueued collective is below `seq` never reached it.
        missing = sorted(r for r in by_rank if enq[r] < seq and done[r] < seq)
        silent = sorted(members - dumped) if not missing else []
        op = next((e.op for es in by_rank.values() for e in es if e.seq == seq), "")
        name = f"{key[0]}:{key[1]}" if key[1] and key[1] != "undefined" else key[0]
        out.append(Verdict(pg=name, seq=seq, op=op, expected=tuple(sorted(members)), missing=tuple(missing),
                           silent=tuple(silent)))
    return sorted(out, key=lambda v: (v.seq, v.pg))


@dataclass(frozen=True, slots=True)
class SettledJob:
    """A job's dumps taken out of the detector to be judged (once)."""

    job: str
    """Job name."""
    dumps: Mapping[int, RankDump]
    """Rank -> its dump."""
    ts: float
    """When the last dump arrived."""


class FlightRecorderDetector:
    """Collects a job's dumps as they arrive and judges them once they have settled.

    Nothing is analysed while dumps still arrive: completeness is known from the ranks
    each dump's process groups name, so a job's dumps are analysed exactly once.
    """

    id = DETECTOR_ID

    def __init__(self, *, settle_s: float = 10.0) -> None:
        self.settle_s = settle_s
        self._dumps: dict[str, dict[int, RankDump]] = {}
        self._members: dict[str, set[int]] = {}
        self._last: dict[str, float] = {}
        self._reported: dict[str, set[str]] = {}

    def add(self, job: str, dump: RankDump, ts: float) -> None:
        """Keep one rank's dump of `job` (a newer dump of the same rank replaces it)."""
        self._dumps.setdefault(job, {})[dump.rank] = dump
        members = self._members.setdefault(job, set())
        for pg in {e.pg for e in dump.doc.entries}:
            members.update(dump.doc.ranks_of(*pg))
        self._last[job] = max(self._last.get(job, ts), ts)

    def take_settled(self, now: float) -> list[SettledJob]:
        """Remove and return the jobs whose dumps are all in or stopped arriving `settle_s` ago (cheap)."""
        out: list[SettledJob] = []
        for job in list(self._dumps):
            dumps = self._dumps[job]
            members = self._members.get(job, set())
            complete = bool(members) and members <= set(dumps)
            if not complete and now - self._last[job] < self.settle_s:
                continue
            del self._dumps[job]
            self._members.pop(job, None)
            out.append(SettledJob(job, dumps, self._last.pop(job)))
        return out

    def judge(self, settled: SettledJob) -> Finding | None:
        """The finding for one settled job's dumps (the heavy part; touches no detector state)."""
        return self._finding(settled.job, settled.dumps, analyze(settled.dumps.values()), settled.ts)

    def first_report(self, finding: Finding) -> bool:
        """True the first time a finding id is seen, so each stuck collective is reported once."""
        reported = self._reported.setdefault(finding.where.job_key or "", set())
        if finding.id in reported:
            return False
        reported.add(finding.id)
        return True

    def forget(self, job: str) -> None:
        """Drop the dumps and reports of a job that left the book."""
        for kept in (self._dumps, self._members, self._last, self._reported):
            kept.pop(job, None)

    def evaluate(self, now: float) -> list[Finding]:
        """Findings for jobs whose dumps stopped arriving `settle_s` ago (or are all in)."""
        out: list[Finding] = []
        for settled in self.take_settled(now):
            f = self.judge(settled)
            if f is not None and self.first_report(f):
                out.append(f)
        return out

    def _finding(self, job: str, dumps: Mapping[int, RankDump], verdicts: list[Verdict],
                 ts: float) -> Finding | None:
        if not verdicts:
            return None
        v = verdicts[0]
        culprits = v.culprits
        node = None
        if culprits and culprits[0] in dumps:
            node = dumps[culprits[0]].node
        fields = {"pg": v.pg, "seq": str(v.seq), "op": v.op, "ranks": str(len(v.expected)),
                  "dumps": str(len(dumps)), "missing_ranks": ",".join(map(str, v.missing[:64])),
                  "silent_ranks": ",".join(map(str, v.silent[:64]))}
        if culprits:
            fields["culprit_rank"] = str(culprits[0])
            who = "never joined" if v.missing else "wrote no dump while every other rank waited in"
            msg = (f"job {job}: rank(s) {','.join(map(str, culprits[:8]))} {who} collective #{v.seq} ({v.op}) "
                   f"of process group {v.pg}")
        else:
            msg = f"job {job}: every rank joined collective #{v.seq} ({v.op}) of {v.pg} and none completed"
        return Finding(
            id=f"{DETECTOR_ID}:{job}:{v.pg}:{v.seq}", ts=ts, fault_class=FaultClass.HANG, severity=Severity.ERROR,
            hardware=False, where=job_location(job, node=node, rank=culprits[0] if culprits else None),
            rule_id=DETECTOR_ID, recommended_action=Action.RESTART_JOB,
            evidence=tuple(d.source for d in dumps.values() if d.source), message=msg,
            symptom_of=HANG_CAUSES, fields=fields,
        )
