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

import ast
import io
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from analyzer.detectors import HANG_CAUSES
from analyzer.records import Action, FaultClass, Finding, Location, Severity

DETECTOR_ID = "flight-recorder"
MAX_DUMP_BYTES = 64 * 1024 * 1024
"""Larger dumps are refused (the default 2,000-entry buffer is a few MB)."""


class DumpError(ValueError):
    """A dump is not a Flight Recorder pickle we can read safely."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, bools and None; refuses every global."""

    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"refused to load {module}.{name}: Flight Recorder dumps hold only plain values")


def load_dump(data: bytes) -> dict[str, Any]:
    """Parse one rank's dump safely."""
    if len(data) > MAX_DUMP_BYTES:
        raise DumpError(f"dump of {len(data)} bytes is larger than {MAX_DUMP_BYTES}")
    try:
        doc = _PlainUnpickler(io.BytesIO(data)).load()
    except DumpError:
        raise
    except Exception as exc:  # any malformed pickle: truncated, wrong opcode, bad protocol
        raise DumpError(f"not a readable pickle: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise DumpError("not a Flight Recorder dump: no 'entries' list")
    return doc


@dataclass(frozen=True, slots=True)
class RankDump:
    """One rank's dump with where it came from."""

    rank: int
    """Global rank that wrote it."""
    node: str
    """Node it came from."""
    doc: Mapping[str, Any]
    """The parsed dump."""
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


def _completed(e: Mapping[str, Any]) -> bool:
    # NCCL marks the state; gloo leaves "scheduled" and retires the entry once it finishes.
    return e.get("state") == "completed" or e.get("retired") is True


def _ranks_of(doc: Mapping[str, Any], pg: str, desc: str) -> list[int]:
    cfg = doc.get("pg_config") or {}
    entry = cfg.get(pg)
    if entry is None:
        same = [c for c in cfg.values() if isinstance(c, Mapping) and c.get("desc") == desc]
        entry = same[0] if len(same) == 1 else (next(iter(cfg.values())) if len(cfg) == 1 else None)
    if not isinstance(entry, Mapping):
        return []
    try:
        ranks = ast.literal_eval(str(entry.get("ranks", "[]")))  # a literal list, never eval
    except (ValueError, SyntaxError):
        return []
    return [int(r) for r in ranks] if isinstance(ranks, list | tuple) else []


def analyze(dumps: Iterable[RankDump]) -> list[Verdict]:
    """Verdicts for the process groups whose collectives did not all complete, lowest seq first."""
    per_pg: dict[tuple[str, str], dict[int, list[Mapping[str, Any]]]] = {}
    expected: dict[tuple[str, str], set[int]] = {}
    dumped: set[int] = set()
    for d in dumps:
        dumped.add(d.rank)
        for e in d.doc.get("entries", []):
            if not isinstance(e, Mapping) or e.get("is_p2p") or not e.get("collective_seq_id"):
                continue
            pg = e.get("process_group") or ("", "")
            key = (str(pg[0]), str(pg[1]) if len(pg) > 1 else "")
            per_pg.setdefault(key, {}).setdefault(d.rank, []).append(e)
            if key not in expected:
                expected[key] = set(_ranks_of(d.doc, *key))
    out: list[Verdict] = []
    for key, by_rank in per_pg.items():
        members = expected[key] or set(by_rank)
        done = {r: max((int(e["collective_seq_id"]) for e in es if _completed(e)), default=0)
                for r, es in by_rank.items()}
        enq = {r: max(int(e["collective_seq_id"]) for e in es) for r, es in by_rank.items()}
        pending = [int(e["collective_seq_id"]) for es in by_rank.values() for e in es if not _completed(e)]
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
        op = next((str(e.get("profiling_name", "")) for es in by_rank.values() for e in es
                   if int(e["collective_seq_id"]) == seq), "")
        name = f"{key[0]}:{key[1]}" if key[1] and key[1] != "undefined" else key[0]
        out.append(Verdict(pg=name, seq=seq, op=op, expected=tuple(sorted(members)), missing=tuple(missing),
                           silent=tuple(silent)))
    return sorted(out, key=lambda v: (v.seq, v.pg))


class FlightRecorderDetector:
    """Collects a job's dumps as they arrive and judges them once they have settled."""

    id = DETECTOR_ID

    def __init__(self, *, settle_s: float = 10.0) -> None:
        self.settle_s = settle_s
        self._dumps: dict[str, dict[int, RankDump]] = {}
        self._last: dict[str, float] = {}
        self._reported: set[str] = set()

    def add(self, job: str, dump: RankDump, ts: float) -> None:
        """Keep one rank's dump of `job` (a newer dump of the same rank replaces it)."""
        self._dumps.setdefault(job, {})[dump.rank] = dump
        self._last[job] = max(self._last.get(job, ts), ts)

    def evaluate(self, now: float) -> list[Finding]:
        """Findings for jobs whose dumps stopped arriving `settle_s` ago (or are all in)."""
        out: list[Finding] = []
        for job in list(self._dumps):
            dumps = self._dumps[job]
            verdicts = analyze(dumps.values())
            complete = bool(verdicts) and set(verdicts[0].expected) <= set(dumps)
            if not complete and now - self._last[job] < self.settle_s:
                continue
            del self._dumps[job]
            f = self._finding(job, dumps, verdicts, self._last.pop(job))
            if f is not None and f.id not in self._reported:
                self._reported.add(f.id)
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
            hardware=False, where=Location(node=node, rank=culprits[0] if culprits else None, job=job),
            rule_id=DETECTOR_ID, recommended_action=Action.RESTART_JOB,
            evidence=tuple(d.source for d in dumps.values() if d.source), message=msg,
            symptom_of=HANG_CAUSES, fields=fields,
        )
