"""A pod's filesystem as this node sees it, and ``find_checkpoint`` requests answered from it.

A job's checkpoints sit on a volume mounted into its pods (a PVC, NFS, a hostPath, a local
NVMe): the control plane mounts none of them. The node agent does, in effect: with the
host's PID namespace it finds a process of the pod (its cgroup path names the pod UID) and
reads ``/proc/<pid>/root/<checkpoint path>``, the container's own view of its mounts. No
volume is mounted into the agent and no path is guessed.

Symbolic links in the checkpoint path are refused: behind ``/proc/<pid>/root`` an absolute
link would resolve against the agent's root, i.e. the host's.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from collector.node_requests import Answer, NodeRequest

Discover = Callable[[Path], Mapping[str, Any]]
"""Checkpoint discovery under a directory: ``{"latest": {"path", "step", "format"} | None,
"skipped": [[path, why], …]}`` (the composition root passes ``healer.checkpoints``' search)."""


def _uid_forms(uid: str) -> tuple[str, str]:
    # cgroup v1 (cgroupfs driver) spells the pod UID with dashes, the systemd driver with underscores.
    return uid.replace("_", "-"), uid.replace("-", "_")


def pod_pids(proc_root: Path, pod_uid: str) -> Iterator[int]:
    """PIDs whose cgroup path names the pod (its containers' processes and its sandbox)."""
    forms = _uid_forms(pod_uid.lower())
    needles = tuple(f"pod{f}" for f in forms)
    for entry in sorted(proc_root.iterdir(), key=lambda p: p.name) if proc_root.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:
            continue  # the process ended, or is not ours to read
        if any(n in text for n in needles):
            yield int(entry.name)


def _no_links(base: Path, rel: Path) -> str:
    """Why ``base/rel`` cannot be read safely (empty when it can): a component is a link, or missing."""
    cur = base
    for part in rel.parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return f"{rel} not found in the pod's filesystem"
        except OSError as exc:
            return f"{rel} unreadable: {exc}"
        if stat.S_ISLNK(st.st_mode):
            return f"{rel} goes through a symbolic link ({cur.relative_to(base)}); not followed"
    return ""


def container_path(proc_root: Path, pod_uid: str, path: str) -> Path | str:
    """The host path of ``path`` as the pod's containers see it, or why there is none."""
    if not pod_uid:
        return "the request names no pod"
    if not path.startswith("/"):
        return f"checkpoint path {path!r} is not absolute"
    rel = Path(os.path.normpath(path)).relative_to("/")
    if ".." in rel.parts:
        return f"checkpoint path {path!r} leaves the pod's filesystem"
    reasons = []
    for pid in pod_pids(proc_root, pod_uid):
        base = proc_root / str(pid) / "root"
        why = _no_links(base, rel)
        if not why:
            return base / rel
        reasons.append(why)
    if not reasons:
        return f"no process of pod {pod_uid} runs on this node"
    return reasons[-1]


class FindCheckpointHandler:
    """``find_checkpoint`` requests: the newest complete checkpoint under a path inside a pod."""

    kind = "find_checkpoint"

    def __init__(self, *, proc_root: Path, discover: Discover) -> None:
        self.proc_root = proc_root
        self.discover = discover

    def run(self, request: NodeRequest, stop: threading.Event) -> Answer:
        p = request.params
        where = container_path(self.proc_root, p.get("pod_uid", ""), p.get("path", ""))
        if isinstance(where, str):
            return Answer("failed", where)
        found = dict(self.discover(where))
        base = str(where)
        # Report paths as the pod sees them: that is what the job resumes from.
        inner = p.get("path", "").rstrip("/") or "/"

        def _pod_view(host: str) -> str:
            return inner + host[len(base):] if host.startswith(base) else host

        latest = found.get("latest")
        if isinstance(latest, Mapping):
            latest = {**latest, "path": _pod_view(str(latest.get("path", "")))}
        skipped = [[_pod_view(str(s[0])), str(s[1])[:200]] for s in found.get("skipped", [])][:5]
        return Answer("done", json.dumps({"latest": latest, "skipped": skipped}, separators=(",", ":")))

    def resume(self, request: NodeRequest) -> Answer:
        # Reading has no side effect: doing it again is the outcome.
        return self.run(request, threading.Event())
