"""Offline log bundles: files, directories, /var/log/pods trees, kubectl dumps, or stdin.

The source reads each file once into lines (container-runtime and kubectl prefixes
stripped) and turns only the lines a caller asks for into Signals, so diagnosing a
multi-gigabyte bundle does not build an object per line. Node, namespace, pod,
container and job come from the path (``/var/log/pods/<ns>_<pod>_<uid>/<container>/N.log``,
``<node>/...`` directories), from the flags, or from the line itself (syslog host,
NCCL's ``host:pid:tid`` prefix). PyTorch Flight Recorder dumps in the bundle
(``[<job>.]comm_lib_trace_rank_<rank>``, older ``nccl_trace_rank_<rank>``) are
binary: they are listed apart, not read as lines.
"""

from __future__ import annotations

import gzip
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import IO

from collector.flight_recorder import parse_dump_name
from collector.identity import job_from_pod, line_rank, pod_identity
from collector.normalize import group_events, prefix_lengths, strip_prefix, without_prefixes
from collector.signal import LogLine, Signal, Source
from collector.timestamps import parse_timestamp


class LogKind(StrEnum):
    """What a file holds, which decides the signal source of its lines."""

    KERNEL = "kernel"
    """Kernel ring buffer, kern.log, syslog or journal."""
    CONTAINER = "container"
    """A container's stdout/stderr (CRI log file or kubectl logs dump)."""
    AUTO = "auto"
    """Unknown: each line is classified on its own."""


@dataclass(frozen=True, slots=True)
class LogFile:
    """One file of a bundle and what its path says about it."""

    name: str
    """Path as found (``-`` for stdin)."""
    kind: LogKind
    """Kernel, container, or decided per line."""
    node: str | None = None
    """Node the file came from, when the path or a flag says."""
    namespace: str | None = None
    """Pod namespace (``/var/log/pods`` layout)."""
    pod: str | None = None
    """Pod name."""
    container: str | None = None
    """Container name."""
    job: str | None = None
    """Training job the pod belongs to."""
    rank: int | None = None
    """Rank of the pod's process, when its labels or name say (a line's own rank prefix wins)."""
    node_hint: str | None = None
    """Node for lines that name none when the path does not say: the host the file's syslog or NCCL lines
    name most, else the bundle's only node."""


@dataclass(slots=True)
class FileLines:
    """The events of one file (prefixes stripped, multi-line events folded), with per-line facts aside."""

    file: LogFile
    """Where they came from."""
    texts: list[str]
    """Event texts, as rules see them."""
    heads: list[int]
    """Line index (in ``raw``) of each event's head."""
    raw: list[str]
    """Every line as read, container-runtime and kubectl prefixes off (timestamps and hosts live here)."""
    stamps: list[str | None]
    """The runtime's timestamp prefix of each line, when it had one."""
    pods: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Pod and container of lines from a ``kubectl logs --prefix`` dump, by line index."""


_PREFIX_SAMPLE = 2000
"""Lines looked at to decide whether a file carries syslog/dmesg/kmsg prefixes at all."""
_PODS_DIR = re.compile(r"^(?P<ns>[^_/]+)_(?P<pod>[^_/]+)_(?P<uid>[0-9a-fA-F-]{8,})$")
_KERNEL_NAME = re.compile(r"(?:^|[-_.])(?:dmesg|kern|kernel|kmsg|messages|syslog|journal)(?:$|[-_.])", re.I)
_KERNEL_LINE = re.compile(
    r"^\s*(?:<\d>)?\[\s*\d+\.\d+\]|\bkernel: |^\s*\[\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4}\]|^\s*kern\s*:"
    # Messages only the kernel writes, copied into a container's log (the GPU operator's driver pod).
    r"|^\s*NVRM: |^\s*(?:pcieport|nvidia) [0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]: "
)
_CRI = re.compile(r"^(\S+) (?:stdout|stderr) ([PF]) ?(.*)$")
_KUBECTL_PREFIX = re.compile(r"^\[pod/([^/\]]+)/([^\]]+)\] (.*)$")
_SYSLOG_HOST = re.compile(r"^\s*\w{3} +\d+ \d\d:\d\d:\d\d(?:\.\d+)? (\S+) ")
_NCCL_HOST = re.compile(r"^(?:\[rank\d+\]:)?\s*([A-Za-z0-9][A-Za-z0-9.-]*):\d+:\d+ \[\d+\]")
__all__ = ["BundleDump", "BundleSource", "FileLines", "LogFile", "LogKind", "job_from_pod"]


def _describe(path: Path, root: Path | None, node: str | None, job: str | None,
              labels: Mapping[str, Mapping[str, str]]) -> LogFile:
    parts = path.parts
    ns = pod = container = None
    kind = LogKind.KERNEL if _KERNEL_NAME.search(path.name) else LogKind.AUTO
    if "pods" in parts:
        i = len(parts) - 1 - parts[::-1].index("pods")
        if i + 2 < len(parts) and (m := _PODS_DIR.match(parts[i + 1])):
            ns, pod, container, kind = m.group("ns"), m.group("pod"), parts[i + 2], LogKind.CONTAINER
    if node is None:
        node = _node_from_path(path, root)
    rank = None
    if pod is not None:
        # The same answer the node agent gives for this pod (labels file, else the pod name).
        job, rank = pod_identity(pod, labels.get(f"{ns}/{pod}") or labels.get(pod), job=job)
    return LogFile(name=str(path), kind=kind, node=node, namespace=ns, pod=pod, container=container, job=job,
                   rank=rank)


_LAYOUT_DIRS = frozenset({"var", "log", "logs", "pods", "containers", "journal", "kubectl", "kernel", "dmesg"})
"""Directory names of a bundle's layout that are never node names."""


def _node_from_path(path: Path, root: Path | None) -> str | None:
    parts = path.parts
    if "var" in parts:
        i = parts.index("var")
        if i > 0 and (root is None or i > len(root.parts) - 1):
            return parts[i - 1]
    if root is not None:
        rel = path.relative_to(root).parts
        if len(rel) >= 2 and rel[0] not in _LAYOUT_DIRS and not _PODS_DIR.match(rel[0]):
            return rel[0]
    return None


_HINT_BYTES = 256 * 1024
"""How much of a file is read to find the host its lines name."""


def _host_hint(path: Path) -> str | None:
    """The host a file's syslog (``Dec  2 11:38:47 worker4 kernel: ...``) or NCCL (``worker4:123:456 [0]``)
    lines name most, from its first bytes."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                head = fh.read(_HINT_BYTES)
        else:
            with open(path, "rb") as fh:
                head = fh.read(_HINT_BYTES)
    except (OSError, EOFError):
        return None
    hosts: Counter[str] = Counter()
    for ln in head.decode("utf-8", "replace").splitlines():
        if (m := _CRI.match(ln)) is not None:
            ln = m.group(3)
        if (host := _node_from_line(ln)) is not None and host not in ("localhost", "kernel"):
            hosts[host] += 1
    return hosts.most_common(1)[0][0] if hosts else None


@dataclass(frozen=True, slots=True)
class BundleDump:
    """A Flight Recorder dump found in a bundle."""

    path: Path
    """The file."""
    job: str | None
    """Job from the file name or the ``--job`` flag."""
    rank: int
    """Rank from the file name."""
    node: str | None
    """Node from the path or the ``--node`` flag."""


class BundleSource:
    """Reads a bundle given as paths (files, directories, ``-`` for stdin)."""

    def __init__(
        self, paths: Sequence[str], *, node: str | None = None, job: str | None = None,
        stdin: IO[bytes] | None = None, pod_labels: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.paths = list(paths)
        self.pod_labels = dict(pod_labels or {})
        self.node = node
        self.job = job
        self.stdin = stdin

    def _paths(self) -> list[tuple[Path, Path | None]]:
        out: list[tuple[Path, Path | None]] = []
        for p in self.paths:
            path = Path(p)
            if p != "-" and path.is_dir():
                out.extend((f, path) for f in sorted(x for x in path.rglob("*")
                                                     if x.is_file() and not x.name.startswith(".")))
            elif p != "-":
                out.append((path, None))
        return out

    def files(self) -> list[LogFile]:
        """Every log file of the bundle (Flight Recorder dumps aside), in a stable order."""
        out: list[LogFile] = []
        if "-" in self.paths:
            out.append(LogFile(name="-", kind=LogKind.AUTO, node=self.node, job=self.job))
        for path, root in self._paths():
            if parse_dump_name(path.name) is None:
                f = _describe(path, root, self.node, self.job, self.pod_labels)
                out.append(f if f.node else replace(f, node_hint=_host_hint(path)))
        # A bundle from one node: its files that name no node are that node's (a pod log beside its syslog).
        nodes = {f.node or f.node_hint for f in out} - {None}
        if len(nodes) == 1:
            out = [f if f.node or f.node_hint else replace(f, node_hint=next(iter(nodes))) for f in out]
        return out

    def dumps(self) -> list[BundleDump]:
        """The Flight Recorder dumps of the bundle, found by file name."""
        out: list[BundleDump] = []
        for path, root in self._paths():
            parsed = parse_dump_name(path.name)
            if parsed is not None:
                node = self.node or _node_from_path(path, root)
                out.append(BundleDump(path=path, job=parsed[0] or self.job, rank=parsed[1], node=node))
        return out

    def _read(self, f: LogFile) -> str:
        if f.name == "-":
            raw = (self.stdin or sys.stdin.buffer).read()
        elif f.name.endswith(".gz"):
            with gzip.open(f.name, "rb") as fh:
                raw = fh.read()
        else:
            raw = Path(f.name).read_bytes()
        return raw.decode("utf-8", "replace")

    def lines(self, f: LogFile) -> FileLines:
        """The file's lines with CRI (``<ts> <stream> <P|F> ``) and kubectl prefixes stripped."""
        raw = self._read(f).splitlines()
        texts: list[str] = []
        stamps: list[str | None] = []
        pods: dict[int, tuple[str, str]] = {}
        partial = ""
        cri = f.kind is LogKind.CONTAINER or bool(raw and _CRI.match(raw[0]))
        for ln in raw:
            if cri and (m := _CRI.match(ln)):
                if m.group(2) == "P":  # partial line: the runtime split a long line, join it back
                    partial += m.group(3)
                    continue
                texts.append(partial + m.group(3))
                stamps.append(m.group(1))
                partial = ""
                continue
            if (k := _KUBECTL_PREFIX.match(ln)) is not None:
                pods[len(texts)] = (k.group(1), k.group(2))
                ln = k.group(3)
            texts.append(ln)
            stamps.append(None)
        if partial:
            texts.append(partial)
            stamps.append(None)
        if any(strip_prefix(t).length for t in texts[:_PREFIX_SAMPLE]):
            lengths = prefix_lengths(texts)
            bare, prefixed = without_prefixes(texts, lengths), list(map(bool, lengths))
        else:  # a container's own output: no transport prefixes to take off
            bare, prefixed = texts, [False] * len(texts)
        events = group_events(bare, texts, prefixed)
        return FileLines(file=f, texts=events.texts, heads=events.lines, raw=texts, stamps=stamps, pods=pods)

    def signal(self, fl: FileLines, i: int) -> Signal:
        """The Signal for event ``i`` of a file: source, node, pod metadata and time resolved."""
        f, text, line = fl.file, fl.texts[i], fl.heads[i]
        raw = fl.raw[line]
        prefix = strip_prefix(raw)  # only for the lines a rule matched: what their prefix says
        kind = f.kind
        if kind is LogKind.AUTO:
            kind = LogKind.KERNEL if prefix.kernel or _KERNEL_LINE.search(raw) else LogKind.CONTAINER
        source = Source.KERNEL if kind is LogKind.KERNEL else Source.CONTAINER
        pod, container, job, rank = f.pod, f.container, f.job, f.rank
        if line in fl.pods:
            pod, container = fl.pods[line]
            job, rank = pod_identity(pod, self.pod_labels.get(pod), job=self.job)
        named = line_rank(text) if source is Source.CONTAINER else None
        node = f.node or prefix.host or _node_from_line(raw) or f.node_hint or "unknown"
        return Signal(
            id=f"{node}:{source.value}:{f.name}:{line}", node=node, source=source, ts=_time_of(fl, line),
            payload=LogLine(text=text, namespace=f.namespace, pod=pod, container=container, job=job,
                            rank=named if named is not None else rank),
        )


def _node_from_line(text: str) -> str | None:
    m = _SYSLOG_HOST.match(text) or _NCCL_HOST.match(text)
    return m.group(1) if m else None


def _time_of(fl: FileLines, i: int) -> float:
    """Time of line i: its own stamp, else the nearest earlier stamp plus line distance, else line order."""
    for j in range(i, max(i - 200, -1), -1):
        stamp = fl.stamps[j]
        parsed = parse_timestamp(stamp) if stamp else parse_timestamp(fl.raw[j])
        if parsed is not None:
            return parsed[0] + (i - j) * 1e-6
    return float(i)
