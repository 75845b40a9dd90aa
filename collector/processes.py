"""Training processes on this node, seen through the host's ``/proc`` (the agent runs with host PID access).

A training process is one whose environment has ``RANK`` and ``WORLD_SIZE`` (torchrun,
DeepSpeed and Lightning launchers set them). Which job it belongs to is told, in turn, by:

- its pod: the pod UID in its cgroup, or else its ``HOSTNAME`` (the kubelet sets it to the
  pod name) when exactly one pod of that name logs on this node, matched to the pod's log
  directory ``<namespace>_<pod>_<uid>`` under ``/var/log/pods``; the pod's labels (in-cluster
  API or labels file) name the job, else the pod name does, exactly as for its log lines;
- ``KMEND_JOB`` in its environment (what the progress hook reports under);
- torchrun's ``TORCHELASTIC_RUN_ID`` (unless it is torchrun's default, ``none``).

Every name that applies is kept, so a request for the job under any of them finds it.
The process's state letter from ``/proc/<pid>/stat`` is kept as well: ``T`` (stopped by a
signal) or ``t`` (stopped by a tracer) means the process is not running at all.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from collector.identity import pod_identity
from collector.podmeta import PodMetadataProvider

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
STOPPED_STATES = frozenset({"T", "t"})
"""``/proc/<pid>/stat`` states of a process that does not run: stopped by a signal, or by a tracer."""
_TORCHRUN_DEFAULT_RUN_ID = "none"
"""torchrun's ``--rdzv-id`` when none is given: it names no job."""
_PF_KTHREAD = 0x00200000
"""``/proc/<pid>/stat`` flag of a kernel thread (``PF_KTHREAD``): no program can set it."""
_CLK_TCK = os.sysconf("SC_CLK_TCK")
SETTLE_S = 2.0
"""A process younger than this that is no rank is looked at again (it may not have reached its ``exec`` yet)."""


@dataclass(frozen=True, slots=True)
class TrainingProcess:
    """One rank's process as seen from the host."""

    pid: int
    """Host PID."""
    rank: int
    """Global rank (``RANK``)."""
    job: str | None
    """Training job, when its pod or environment tell it (the first of `names`)."""
    pipe: str | None
    """Path (inside the process's root) of its Flight Recorder trigger FIFO, when configured."""
    names: tuple[str, ...] = ()
    """Every name the job is known under here: its pod's job, ``KMEND_JOB``, torchrun's run id."""
    state: str = ""
    """State letter from ``/proc/<pid>/stat`` (``R`` running, ``S`` sleeping, ``T`` stopped, ...)."""
    started: int = 0
    """Start time in clock ticks after boot: with `pid`, tells this process from a later one with its PID."""
    pod: str | None = None
    """``namespace/pod`` it runs in, when known."""

    @property
    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP, a tracer): it runs no code at all."""
        return self.state in STOPPED_STATES


def read_environ(proc: Path) -> dict[str, str] | None:
    """A process's environment (None when it cannot be read: gone, a zombie, or not permitted)."""
    try:
        raw = (proc / "environ").read_bytes()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` used here."""

    comm: str
    """Command name (changes at ``exec``)."""
    state: str
    """State letter."""
    ppid: int
    """Parent PID."""
    started: int
    """Start time, clock ticks after boot."""
    flags: int = 0
    """Kernel flags (``PF_*``)."""
    cpu_ticks: int = 0
    """CPU time used, user and system (``utime + stime``), in clock ticks."""

    @property
    def kernel_thread(self) -> bool:
        """A kernel thread: no program, no environment, in no pod."""
        return bool(self.flags & _PF_KTHREAD)

    @property
    def cpu_s(self) -> float:
        """CPU time used, user and system, in seconds."""
        return self.cpu_ticks / _CLK_TCK


def read_stat(proc: Path) -> ProcStat | None:
    """Parsed ``/proc/<pid>/stat``, or None when the process is gone."""
    try:
        text = (proc / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    if len(fields) < 20:
        return None
    return ProcStat(comm=head.partition("(")[2], state=fields[0], ppid=int(fields[1]), started=int(fields[19]),
                    flags=int(fields[6]), cpu_ticks=int(fields[11]) + int(fields[12]))


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Every process on the node (not only ranks): which pods and jobs still have one here."""

    complete: bool
    """Every process could be read (environment and cgroup); when False nothing can be told from an absence."""
    pod_uids: frozenset[str]
    """Pod UIDs in the processes' cgroups."""
    hostnames: frozenset[str]
    """``HOSTNAME`` values (the kubelet sets it to the pod name)."""
    names: frozenset[str]
    """Job names in the processes' environments: ``KMEND_JOB``, torchrun's ``TORCHELASTIC_RUN_ID``."""


def host_view(proc_root: Path) -> bool:
    """Whether `proc_root` shows the host's processes: kernel threads (kthreadd is PID 2) are visible only from
    the host's PID namespace. A container without host PID access sees its own processes alone."""
    st = read_stat(proc_root / "2")
    return st is not None and st.ppid == 0 and st.kernel_thread


class ProcessFinder:
    """Training processes on this node (``/proc`` and the pod log root injected)."""

    def __init__(self, *, proc_root: Path = Path("/proc"), pods_root: Path | None = Path("/var/log/pods"),
                 pod_metadata: PodMetadataProvider | None = None, job: str | None = None) -> None:
        self.proc_root = proc_root
        self.pods_root = pods_root
        self.pod_metadata = pod_metadata
        self.job = job
        """The agent's ``--job``: the job of every pod on the node (as for its log lines)."""
        # (pid, start, comm) -> (rank, environment) or None: an environment is read once per program.
        self._seen: dict[tuple[int, int, str], tuple[int, Mapping[str, str]] | None] = {}
        # (pid, start, comm) -> (pod UID, HOSTNAME, job names) of any process, or None when unreadable.
        self._traits: dict[tuple[int, int, str], tuple[str | None, str | None, tuple[str, ...]] | None] = {}

    def _pod_dirs(self) -> list[str]:
        if self.pods_root is None:
            return []
        try:
            return os.listdir(self.pods_root)
        except OSError:
            return []

    def _pod_of(self, proc: Path, env: Mapping[str, str], dirs: list[str]) -> tuple[str, str, str] | None:
        """(namespace, pod, uid) of the pod the process runs in, from its cgroup or its HOSTNAME."""
        try:
            m = _POD_UID.search((proc / "cgroup").read_text())
        except OSError:
            m = None
        if m is not None:
            uid = m.group(1).replace("_", "-")  # the systemd cgroup driver writes the UID with underscores
            mine = [d for d in dirs if d.endswith("_" + uid)]
        else:
            host = env.get("HOSTNAME", "")
            # Two namespaces may hold pods of one name: then the host name alone cannot tell which.
            mine = [d for d in dirs if host and d.count("_") == 2 and d.split("_")[1] == host]
            if len(mine) > 1 and len({d.split("_", 1)[0] for d in mine}) == 1 and self.pods_root is not None:
                # One pod name reused in one namespace (a job run again): the old pod's directory stays until it
                # is deleted, and the running process's pod is the one whose log was written last.
                newest = sorted((_last_write(self.pods_root / d), d) for d in mine)
                mine = [newest[-1][1]] if newest[-1][0] > newest[-2][0] else mine
        if len(mine) != 1:
            return None
        ns, pod, uid = mine[0].split("_", 2)
        return ns, pod, uid

    def _job_of_pod(self, ref: tuple[str, str, str]) -> str | None:
        ns, pod, uid = ref
        labels = None
        if self.pod_metadata is not None:
            try:
                labels = self.pod_metadata.labels(ns, pod, uid)
            except Exception:
                return None
        return pod_identity(pod, labels, job=self.job)[0]

    def _settled_before(self) -> float:
        """Start time (clock ticks after boot) before which a process has long passed its ``exec``; infinite
        when the proc root shows no uptime (every process counts as settled)."""
        try:
            up = float((self.proc_root / "uptime").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return math.inf
        return (up - SETTLE_S) * _CLK_TCK

    def _stats(self) -> Iterator[tuple[str, Path, ProcStat]]:
        """Each process directory under the proc root with its stat (those gone meanwhile left out)."""
        for entry in os.listdir(self.proc_root):
            if entry.isdigit() and (st := read_stat(proc := self.proc_root / entry)) is not None:
                yield entry, proc, st

    def occupancy(self) -> Occupancy:
        """The pods and job names of every process on the node, by the rules `find` names a rank's job with."""
        uids: set[str] = set()
        hosts: set[str] = set()
        names: set[str] = set()
        complete = True
        live: set[tuple[int, int, str]] = set()
        for entry, proc, st in self._stats():
            # Kernel threads run no program; PID 1 of the host's namespace is its init, in no pod; a zombie (or a
            # process being reaped) runs nothing, and its environment can no longer be read.
            if st.kernel_thread or entry == "1" or st.state in ("Z", "X"):
                continue
            key = (int(entry), st.started, st.comm)
            live.add(key)
            if key not in self._traits:
                self._traits[key] = _traits(proc)
            got = self._traits[key]
            if got is None:
                complete = complete and read_stat(proc) is None  # gone meanwhile: no process to count
                continue
            uid, host, named = got
            if uid:
                uids.add(uid)
            if host:
                hosts.add(host)
            names.update(named)
        for gone in [k for k in self._traits if k not in live]:
            del self._traits[gone]
        return Occupancy(complete, frozenset(uids), frozenset(hosts), frozenset(names))

    def find(self) -> list[TrainingProcess]:
        """The topmost process of each rank (a DataLoader worker shares its parent's ``RANK``)."""
        found: dict[int, tuple[int, Mapping[str, str], Path, ProcStat]] = {}
        live: set[tuple[int, int, str]] = set()
        settled = self._settled_before()
        for entry, proc, st in self._stats():
            key = (int(entry), st.started, st.comm)
            live.add(key)
            if key in self._seen:
                got = self._seen[key]
            else:
                env = read_environ(proc)
                ok = env is not None and env.get("RANK", "").isdigit() and "WORLD_SIZE" in env
                got = (int(env["RANK"]), env) if ok and env is not None else None
                # Between fork and exec a launcher's child still has the launcher's environment and, when both
                # are ``python``, its command name: a young process is no rank only until it is read again.
                if got is not None or st.started <= settled:
                    self._seen[key] = got
            if got is not None:
                found[int(entry)] = (got[0], got[1], proc, st)
        for gone in [k for k in self._seen if k not in live]:
            del self._seen[gone]
        dirs = self._pod_dirs()
        out = []
        for pid, (rank, penv, proc, st) in sorted(found.items()):
            parent = found.get(st.ppid)
            if parent is not None and parent[0] == rank:
                continue
            ref = self._pod_of(proc, penv, dirs)
            names = [self._job_of_pod(ref) if ref else None, penv.get("KMEND_JOB"), penv.get("TORCHELASTIC_RUN_ID")]
            unique = tuple(dict.fromkeys(n for n in names if n and n != _TORCHRUN_DEFAULT_RUN_ID))
            pipe = penv.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
            out.append(TrainingProcess(pid=pid, rank=rank, job=unique[0] if unique else None,
                                       pipe=f"{pipe}{rank}.pipe" if pipe else None, names=unique, state=st.state,
                                       started=st.started, pod=f"{ref[0]}/{ref[1]}" if ref else None))
        return out


def _traits(proc: Path) -> tuple[str | None, str | None, tuple[str, ...]] | None:
    """(pod UID from the cgroup, HOSTNAME, job names in the environment) of one process; None when unreadable."""
    try:
        m = _POD_UID.search((proc / "cgroup").read_text())
    except OSError:
        return None
    env = read_environ(proc)
    if env is None:
        # Its pod is still told by its cgroup; without either, where it runs is unknown.
        return (m.group(1).replace("_", "-"), None, ()) if m else None
    named = tuple(n for n in (env.get("KMEND_JOB"), env.get("TORCHELASTIC_RUN_ID"))
                  if n and n != _TORCHRUN_DEFAULT_RUN_ID)
    return (m.group(1).replace("_", "-") if m else None), env.get("HOSTNAME") or None, named


LogState = tuple[tuple[str, str, int, int], ...]
"""(container, file, size, mtime in ns) of each file of a pod's log directory."""


def log_state(pod_dir: os.PathLike[str]) -> LogState:
    """The files of a pod's log directory as they are now (empty when it cannot be read)."""
    out = []
    try:
        containers = sorted(os.listdir(pod_dir))
    except OSError:
        return ()
    for c in containers:
        try:
            with os.scandir(os.path.join(pod_dir, c)) as files:
                for f in files:
                    st = f.stat()
                    out.append((c, f.name, st.st_size, st.st_mtime_ns))
        except OSError:
            continue
    return tuple(sorted(out))


def _last_write(pod_dir: Path) -> int:
    """When any log file of a pod's directory was last written (ns since the epoch; 0 when unreadable)."""
    return max((f[3] for f in log_state(pod_dir)), default=0)
