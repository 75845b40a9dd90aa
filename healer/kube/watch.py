"""PodInformer: every unfinished pod kept current by a ``ListWatchCache``, with the change log the scheduler drains.

The list, the watch from the list's ``resourceVersion`` (with bookmarks), the watch again from the last version
after a stream ends, and the list again after a 410 Gone are the cache's (``healer.kube.cache``), as for nodes and
PodGroups. On top of it the informer records each ADDED / MODIFIED / DELETED in a change log that ``drain`` hands
over (every pod after a list: a full drain), indexes the pods by the node they are bound to, and keeps with each pod
what the healer asks of it (owners, phase) so that "which pods run on this node now" is answered from the watch.

Events are read raw (``_preload_content=False``) and parsed as JSON lines, as the lists are:
building client models for every pod event would cost more than the rest of the cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from healer.gang.port import PodKey
from healer.gang.records import PodRecord
from healer.kube.cache import Key, ListWatchCache
from healer.workloads import OwnerRef, PodInfo

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Drained:
    """What the informer saw since the previous drain."""

    full: bool
    """The pods were listed again (first list or an expired watch): ``pods`` is every pod."""
    pods: tuple[PodRecord, ...]
    """Pods added or changed, latest state; every unfinished pod when ``full``."""
    gone: tuple[PodKey, ...]
    """Pods deleted or finished and not recreated (empty when ``full``)."""


@dataclass(frozen=True, slots=True)
class WatchedPod:
    """One unfinished pod as the watch last showed it."""

    record: PodRecord
    """What the gang scheduler reads."""
    owners: tuple[OwnerRef, ...]
    """Owner references (a DaemonSet's pods are no job's)."""
    phase: str
    """``Pending`` or ``Running`` (finished pods are not kept)."""

    def info(self) -> PodInfo:
        """The pod as the healer's ``PodInfo``, without the manifest (a decision reads labels, owners and node)."""
        r = self.record
        return PodInfo(r.namespace, r.name, r.uid, r.node_name, r.labels, r.annotations, self.owners, r.terminating,
                       self.phase, r.created)


def watched_pod(record: Callable[[Json], PodRecord]) -> Callable[[Json], WatchedPod | None]:
    """A converter from a Pod object, through ``record``, to a ``WatchedPod``; None for a finished pod."""

    def convert(obj: Json) -> WatchedPod | None:
        pod = record(obj)
        if pod.finished:
            return None
        refs = (obj.get("metadata") or {}).get("ownerReferences") or ()
        owners = tuple(OwnerRef(o.get("apiVersion", ""), o.get("kind", ""), o.get("name", ""),
                                bool(o.get("controller"))) for o in refs)
        return WatchedPod(pod, owners, (obj.get("status") or {}).get("phase") or "Pending")

    return convert


class PodInformer:
    """All unfinished pods of the cluster, kept current by a watch running in its own thread.

    ``start`` lists synchronously (raising the client's errors), so the first drain is complete;
    ``stop`` ends the thread within ``read_timeout_s``. Between the two the thread never gives up:
    errors are logged and the watch (or the list) is tried again after ``retry_s``. ``list_pods`` is the list call
    of pods of every namespace, with the generated client's keywords (``Rest.lister``).
    """

    def __init__(self, list_pods: Callable[..., Any], record: Callable[[Json], PodRecord], *, page_size: int = 1000,
                 timeout_s: float = 30.0, watch_timeout_s: int = 300, read_timeout_s: float = 10.0,
                 retry_s: float = 1.0, on_change: Callable[[PodRecord], None] | None = None) -> None:
        self.on_change = on_change
        """Called from the watch thread with each pod added or changed (not deleted), after it is recorded."""
        self._log: dict[PodKey, PodRecord | None] = {}
        self._full = False
        self._by_node: dict[str, set[Key]] = {}
        self._node_of: dict[Key, str] = {}
        self.cache: ListWatchCache[WatchedPod] = ListWatchCache(
            "pod", list_pods, watched_pod(record), page_size=page_size, timeout_s=timeout_s,
            watch_timeout_s=watch_timeout_s, read_timeout_s=read_timeout_s, retry_s=retry_s,
            on_object=self._changed, on_listed=self._listed, on_applied=self._applied)

    # Lifecycle.

    def start(self) -> None:
        """List every pod, then watch from the list's version in a daemon thread."""
        self.cache.start()

    def stop(self) -> None:
        """End the watch thread and wait for it."""
        self.cache.stop()

    @property
    def running(self) -> bool:
        """Whether the watch thread is alive."""
        return self.cache.running

    @property
    def lists(self) -> int:
        """Pod lists made (1 after ``start``; one more per expired watch)."""
        return self.cache.lists

    @property
    def watches(self) -> int:
        """Watch requests made."""
        return self.cache.watches

    @property
    def resource_version(self) -> str:
        """The version the next watch starts from (the list's, then each event's or bookmark's)."""
        return self.cache.resource_version

    # Reading.

    def drain(self, *, everything: bool = False) -> Drained:
        """Changes since the previous drain (every pod after a list, or when asked), and clear them."""

        def take(store: Mapping[Key, WatchedPod]) -> Drained:
            if self._full or everything:
                out = Drained(True, tuple(p.record for p in store.values()), ())
            else:
                out = Drained(False, tuple(p for p in self._log.values() if p is not None),
                              tuple(k for k, p in self._log.items() if p is None))
            self._full = False
            self._log.clear()
            return out

        return self.cache.read(take)

    def on_node(self, node: str) -> list[PodInfo] | None:
        """The unfinished pods bound to ``node`` as the watch shows them, or None while it is not in sync."""
        if not self.cache.synced:
            return None
        return self.cache.read(lambda store: [store[k].info() for k in sorted(self._by_node.get(node, ()))
                                              if k in store])

    # Kept under the cache's lock.

    def _listed(self, store: Mapping[Key, WatchedPod]) -> None:
        self._log.clear()
        self._full = True
        self._by_node.clear()
        self._node_of.clear()
        for key, pod in store.items():
            self._index(key, pod.record.node_name)

    def _applied(self, key: Key, pod: WatchedPod | None) -> None:
        self._log[key] = None if pod is None else pod.record
        self._index(key, "" if pod is None else pod.record.node_name)

    def _index(self, key: Key, node: str) -> None:
        before = self._node_of.pop(key, "")
        if before:
            on = self._by_node.get(before)
            if on is not None:
                on.discard(key)
                if not on:
                    del self._by_node[before]
        if node:
            self._node_of[key] = node
            self._by_node.setdefault(node, set()).add(key)

    def _changed(self, pod: WatchedPod) -> None:
        if self.on_change is not None:
            self.on_change(pod.record)
