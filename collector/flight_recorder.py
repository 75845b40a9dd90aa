"""Uploads PyTorch Flight Recorder dumps found on the node to ``POST /v1/flight-recorder``.

On a collective timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) each rank writes one
pickle to ``<prefix><rank>``, the prefix taken from ``TORCH_FR_DUMP_TEMP_FILE`` or
its older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``. PyTorch's default prefix is
``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/torch/comm_lib_trace_rank_``; releases
before it used ``nccl_trace_rank_`` (``/tmp`` in the oldest). Both file names are
recognised. Training pods point the prefix into a host directory the agent mounts
read-only, in one of these layouts (``<root>`` is the mount):

- ``<root>/<job>.comm_lib_trace_rank_<rank>``: the job in the prefix itself
  (``TORCH_FR_DUMP_TEMP_FILE=/fr/$(JOB_NAME).comm_lib_trace_rank_``);
- ``<root>/<namespace>_<pod>_<uid>/comm_lib_trace_rank_<rank>`` (a ``subPathExpr``
  like kubelet's own log directories): job from the pod's labels;
- ``<root>/<job>/comm_lib_trace_rank_<rank>``: job from the directory name.

The writer does not write to a temporary name first, so a dump counts as complete
once its size and modification time have stayed the same for ``settle_s``. Each
complete dump is uploaded once: its identity (size, mtime) is handed back as a
cursor and checkpointed, so a restarted agent does not upload it again; a file
rewritten by a later run of the job is a new dump.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from collector.podmeta import PodMetadataProvider, job_and_rank
from collector.shipper import Outcome
from collector.sources.base import Clock, Cursor, Poll

log = logging.getLogger(__name__)

DEFAULT_PREFIXES: tuple[str, ...] = ("comm_lib_trace_rank_", "nccl_trace_rank_")
"""File-name part of PyTorch's default dump prefix, current and older releases."""
MAX_DUMP_BYTES = 64 * 1024 * 1024
"""Larger files are not dumps the service would accept; they are skipped, not uploaded."""

_POD_DIR = re.compile(r"^(?P<ns>[a-z0-9-]+)_(?P<pod>[a-z0-9.-]+)_(?P<uid>[0-9a-f-]{8,})$")


class DumpUploader(Protocol):
    """Sends one dump to the service.

    Guarantees: never raises on transport errors (they are ``UNAVAILABLE``, to be
    retried); ``REJECTED`` means the service will never accept this body.
    """

    def upload(self, *, job: str, rank: int, node: str, body: bytes) -> Outcome:
        """Post the dump; the outcome decides whether it is retried."""
        ...


class HttpDumpUploader:
    """``POST /v1/flight-recorder?job=&rank=&node=`` with the agent's bearer token."""

    def __init__(self, url: str, *, token: str | None = None, client: httpx.Client | None = None,
                 timeout: float = 10.0) -> None:
        self.url = url.rstrip("/") + "/v1/flight-recorder"
        self._client = client or httpx.Client(timeout=timeout)
        self._headers = {"Content-Type": "application/octet-stream"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def upload(self, *, job: str, rank: int, node: str, body: bytes) -> Outcome:
        """Post the dump; the outcome decides whether it is retried."""
        try:
            resp = self._client.post(self.url, params={"job": job, "rank": rank, "node": node}, content=body,
                                     headers=self._headers)
        except httpx.HTTPError as exc:
            log.debug("service unreachable for a Flight Recorder dump: %s", exc)
            return Outcome.UNAVAILABLE
        if resp.is_success:
            return Outcome.ACCEPTED
        if resp.status_code in (400, 413, 422):
            log.error("service refused Flight Recorder dump (%s): %s", resp.status_code, resp.text[:300])
            return Outcome.REJECTED
        return Outcome.UNAVAILABLE

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


@dataclass(frozen=True, slots=True)
class DumpFile:
    """A dump on disk and whom it belongs to."""

    key: str
    """Path relative to the watched root (the checkpoint key)."""
    job: str | None
    """Training job, when the name, directory or pod labels tell it (``namespace/job`` in a pod's directory)."""
    rank: int
    """Rank that wrote it (the number PyTorch appends to the prefix)."""


def parse_dump_name(name: str, prefixes: Sequence[str] = DEFAULT_PREFIXES) -> tuple[str | None, int] | None:
    """(job or None, rank) from a dump's file name (``[<job>.]<prefix><rank>``); None when it is not one."""
    for prefix in prefixes:
        m = re.fullmatch(rf"(?P<job>.*?){re.escape(prefix)}(?P<rank>\d+)", name)
        if m is not None:
            return m.group("job").rstrip("._-") or None, int(m.group("rank"))
    return None


def identify(root: Path, path: Path, prefixes: Sequence[str], pods: PodMetadataProvider | None) -> DumpFile | None:
    """Job and rank of a dump file, or None when the name is not a dump's.

    Raises what the pod lookup raises (the API server is away), so the caller can try again later.
    """
    parsed = parse_dump_name(path.name, prefixes)
    if parsed is None:
        return None
    key = path.relative_to(root).as_posix()
    job, rank = parsed
    parent = path.parent.name if path.parent != root else ""
    pod = _POD_DIR.match(parent)
    if job is None and pod is not None and pods is not None:
        labels = pods.labels(pod["ns"], pod["pod"], pod["uid"])
        job = job_and_rank(labels)[0] if labels else None
    if job is None and parent and pod is None:
        job = parent
    if job is not None and pod is not None:
        job = f"{pod['ns']}/{job}"  # the job's identity, as its progress and log lines give it
    return DumpFile(key=key, job=job, rank=rank)


class FlightRecorderSource:
    """Watches one host directory (two levels deep) and uploads each complete dump once."""

    name = "flight-recorder"

    def __init__(self, *, node: str, root: Path, uploader: DumpUploader,
                 prefixes: Sequence[str] = DEFAULT_PREFIXES,
                 pod_metadata: PodMetadataProvider | None = None, resume: Mapping[str, Cursor] | None = None,
                 settle_s: float = 5.0, retry_s: float = 10.0, clock: Clock = time.time) -> None:
        self.node = node
        self.root = root
        self.uploader = uploader
        self.prefixes = tuple(prefixes)
        self.pods = pod_metadata
        self.settle_s = settle_s
        self.retry_s = retry_s
        self.clock = clock
        self._retry_at = 0.0
        self.done: dict[str, Cursor] = dict(resume or {})
        """Dumps already handled: key to ``{"size", "mtime_ns", "state"}``."""
        self._seen: dict[str, tuple[int, int, float]] = {}
        self.uploaded = 0
        """Dumps the service accepted since start."""

    def _candidates(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = {p for prefix in self.prefixes for pattern in (f"*{prefix}*", f"*/*{prefix}*")
                 for p in self.root.glob(pattern)}
        return sorted(found)

    def poll(self) -> Poll:
        """Upload the dumps that became complete; their identities are the cursors."""
        now = self.clock()
        cursors: dict[str, Cursor] = {}
        errors = 0
        present: set[str] = set()
        for path in self._candidates():
            if parse_dump_name(path.name, self.prefixes) is None:
                continue
            key = path.relative_to(self.root).as_posix()
            present.add(key)
            try:
                st = path.stat()
            except OSError:
                continue
            ident = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            prev = self.done.get(key)
            if isinstance(prev, dict) and {k: prev.get(k) for k in ident} == ident:
                continue
            if not self._settled(key, st.st_size, st.st_mtime_ns, now) or now < self._retry_at:
                continue
            try:
                # The pod lookup happens here, once per complete dump, not on every poll.
                dump = identify(self.root, path, self.prefixes, self.pods)
            except Exception:
                log.warning("pod lookup for Flight Recorder dump %s failed; trying again later", key)
                continue
            if dump is None:
                continue
            state = self._handle(path, dump, st.st_size)
            if state is None:
                # The service is away: the rest wait, without a connection attempt per poll.
                self._retry_at = now + self.retry_s
                continue
            if state != "uploaded":
                errors += 1
            self.done[key] = cursors[key] = {**ident, "state": state}
        for gone in [k for k in self.done if k not in present]:
            del self.done[gone]
            cursors[gone] = None
        self._seen = {k: v for k, v in self._seen.items() if k in present}
        return Poll(cursors=cursors, lines=len(cursors), errors=errors)

    def _settled(self, key: str, size: int, mtime_ns: int, now: float) -> bool:
        seen = self._seen.get(key)
        if seen is None or seen[:2] != (size, mtime_ns):
            self._seen[key] = (size, mtime_ns, now)
            return False
        return size > 0 and now - seen[2] >= self.settle_s

    def _handle(self, path: Path, dump: DumpFile, size: int) -> str | None:
        """``uploaded``, ``rejected``, ``no-job``, ``too-large``, or None to retry later."""
        if dump.job is None:
            log.warning("Flight Recorder dump %s names no job (see collector/flight_recorder.py for layouts)",
                        dump.key)
            return "no-job"
        if size > MAX_DUMP_BYTES:
            log.warning("Flight Recorder dump %s is %d bytes; not uploaded", dump.key, size)
            return "too-large"
        try:
            body = path.read_bytes()
        except OSError:
            return None
        outcome = self.uploader.upload(job=dump.job, rank=dump.rank, node=self.node, body=body)
        if outcome is Outcome.UNAVAILABLE:
            return None
        if outcome is Outcome.ACCEPTED:
            self.uploaded += 1
            log.info("uploaded Flight Recorder dump %s (job %s, rank %d)", dump.key, dump.job, dump.rank)
            return "uploaded"
        return "rejected"

    def close(self) -> None:
        """Close the uploader's connection when it has one."""
        close = getattr(self.uploader, "close", None)
        if callable(close):
            close()
