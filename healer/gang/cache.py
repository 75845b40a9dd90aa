"""The scheduler's cache: pods, nodes and PodGroups kept between cycles and updated from changes.

kube-scheduler's habit: an informer-fed cache, and each cycle a snapshot taken from it. Per-node
usage and the gangs are updated per changed pod, so a cycle costs what changed plus what is
pending, not a pass over every pod in the cluster. The view handed to a cycle is a copy, so
placement decisions see one consistent state (Volcano's fresh-snapshot rule) while binds and
deletes made during the cycle update the cache for the next one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from healer.gang.config import SchedulerConfig
from healer.gang.gangs import Gang, gang_key, group_of, make_gang, order_key
from healer.gang.nodeindex import NodeIndex
from healer.gang.port import PodChanges, PodKey
from healer.gang.quantity import PODS
from healer.gang.records import PodGroupRecord, PodRecord, Snapshot, bound_to
from healer.gang.reservations import Reservation
from healer.gang.state import ClusterState, Matrix, Vector, request_vector, usage

Size = tuple[tuple[str, int], ...]
"""A pod's requests as a hashable key."""


class SchedulerCache:
    """Unfinished pods, nodes and PodGroups, with usage per node and gangs kept current.

    Invariant (checked by the tests against ``ClusterState`` and ``build_gangs`` over the port's
    snapshot): ``view`` gives the same free resources, terminating nodes and gangs as a state built
    from scratch over the pods the cache holds.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        """Settings; the scheduler name decides which pending pods form gangs."""
        self.cursor = ""
        """Where the next ``changes`` read starts; "" asks the port for everything."""
        self._pods: dict[PodKey, PodRecord] = {}
        self._groups: dict[str, PodGroupRecord] = {}
        self._nodes: NodeIndex | None = None
        self._resources: tuple[str, ...] = (PODS,)
        self._columns: dict[str, int] = {PODS: 0}
        self._sizes: dict[Size, Vector] = {}
        self._used: Matrix = np.zeros((0, 1), dtype=np.int64)
        self._delta_rows: list[int] = []
        self._delta_vecs: list[Vector] = []
        self._terminating = np.zeros(0, dtype=np.int64)
        self._pending: dict[str, dict[PodKey, PodRecord]] = {}
        self._members: dict[str, dict[PodKey, PodRecord]] = {}
        self._gangs: dict[str, Gang] = {}
        self._dirty: set[str] = set()

    # Feeding the cache.

    def apply(self, changes: PodChanges) -> None:
        """Bring the cache to the port's state that ``changes`` describes and move the cursor on."""
        nodes_changed = self._nodes is None or not self._nodes.same(changes.nodes, self.config)
        if nodes_changed:
            self._nodes = NodeIndex(changes.nodes, self.config)
        if changes.full:
            fresh = {(p.namespace, p.name) for p in changes.pods}
            for key in [k for k in self._pods if k not in fresh]:
                self._remove(key, count=not nodes_changed)
        for key in changes.gone:
            self._remove(key, count=not nodes_changed)
        for pod in changes.pods:
            self._put(pod, count=not nodes_changed)
        self._set_groups(changes.pod_groups)
        if nodes_changed:
            self._recount()
        self.cursor = changes.cursor

    def assume_bound(self, pod: PodRecord, node: str) -> None:
        """A Binding call succeeded: count the pod on ``node`` before the port reports it."""
        stored = self._pods.get((pod.namespace, pod.name))
        if stored is not None and stored.uid == pod.uid and not stored.node_name:
            self._put(bound_to(stored, node))

    def assume_deleted(self, pod: PodRecord) -> None:
        """A delete succeeded: a bound pod turns terminating (keeping its resources), a pending one goes."""
        key = (pod.namespace, pod.name)
        stored = self._pods.get(key)
        if stored is None or stored.uid != pod.uid:
            return
        if stored.node_name:
            self._put(dataclasses.replace(stored, terminating=True))
        else:
            self._remove(key)

    # Reading it.

    def has_pending(self) -> bool:
        """Whether any of our pods waits for a node."""
        return bool(self._pending)

    def pods(self) -> tuple[PodRecord, ...]:
        """Every pod held, as a snapshot would list them (order aside)."""
        return tuple(self._pods.values())

    def snapshot(self) -> Snapshot:
        """The cached objects as a snapshot, for checks against a state built from scratch."""
        nodes = self._nodes.nodes if self._nodes is not None else ()
        return Snapshot(nodes, self.pods(), tuple(self._groups.values()))

    def view(self, reservations: tuple[Reservation, ...] = ()) -> tuple[ClusterState, list[Gang]]:
        """One cycle's state (a copy: later changes to the cache do not reach it) and gangs in queue order."""
        if self._nodes is None:
            raise RuntimeError("the cache has not been filled: apply a full change set first")
        self._flush()
        state = ClusterState.of(self._nodes, self.config, self._resources, self._used,
                                self._terminating > 0, reservations)
        for key in self._dirty:
            pods = self._pending.get(key)
            if pods:
                self._gangs[key] = make_gang(pods.values(), self._members.get(key, {}).values(),
                                             self._groups.get(key), self.config)
            else:
                self._gangs.pop(key, None)
        self._dirty.clear()
        return state, sorted(self._gangs.values(), key=order_key)

    # Internals.

    def _put(self, pod: PodRecord, *, count: bool = True) -> None:
        key = (pod.namespace, pod.name)
        old = self._pods.get(key)
        if old is pod:
            return
        if old is not None:
            self._unindex(key, old, count)
        if pod.finished:
            self._pods.pop(key, None)
            return
        self._pods[key] = pod
        self._index(key, pod, count)

    def _remove(self, key: PodKey, *, count: bool = True) -> None:
        old = self._pods.pop(key, None)
        if old is not None:
            self._unindex(key, old, count)

    def _index(self, key: PodKey, pod: PodRecord, count: bool) -> None:
        if pod.node_name:
            if count:
                self._count(pod, 1)
            group = group_of(pod)
            if group and not pod.terminating:
                gkey = f"{pod.namespace}/{group}"
                self._members.setdefault(gkey, {})[key] = pod
                self._dirty.add(gkey)
            return
        if count and not self._columns.keys() >= pod.requests.keys():
            self._add_columns(pod)
        if pod.scheduler_name == self.config.scheduler_name and not pod.terminating:
            gkey = gang_key(pod)
            self._pending.setdefault(gkey, {})[key] = pod
            self._dirty.add(gkey)

    def _unindex(self, key: PodKey, pod: PodRecord, count: bool) -> None:
        if pod.node_name:
            if count:
                self._count(pod, -1)
            group = group_of(pod)
            if group and not pod.terminating:
                gkey = f"{pod.namespace}/{group}"
                self._drop(self._members, gkey, key)
            return
        if pod.scheduler_name == self.config.scheduler_name and not pod.terminating:
            self._drop(self._pending, gang_key(pod), key)

    def _drop(self, table: dict[str, dict[PodKey, PodRecord]], gkey: str, key: PodKey) -> None:
        pods = table.get(gkey)
        if pods is not None and pods.pop(key, None) is not None:
            self._dirty.add(gkey)
            if not pods:
                del table[gkey]

    def _count(self, pod: PodRecord, sign: int) -> None:
        assert self._nodes is not None
        row = self._nodes.index.get(pod.node_name)
        if row is None:
            return
        size = tuple(pod.requests.items())
        vec = self._sizes.get(size)
        if vec is None:
            if not self._columns.keys() >= pod.requests.keys():
                self._add_columns(pod)
            vec = self._sizes[size] = request_vector(self._columns, pod.requests)
        # Summed in one array operation by ``_flush``: a numpy call per pod would cost more than the rest.
        self._delta_rows.append(row)
        self._delta_vecs.append(vec if sign > 0 else -vec)
        if pod.terminating:
            self._terminating[row] += sign

    def _flush(self) -> None:
        if self._delta_rows:
            np.add.at(self._used, np.asarray(self._delta_rows, dtype=np.intp), np.stack(self._delta_vecs))
            self._delta_rows.clear()
            self._delta_vecs.clear()

    def _add_columns(self, pod: PodRecord) -> None:
        """A resource name not seen before: insert zero columns, keeping names sorted."""
        self._flush()
        resources = tuple(sorted(set(self._resources) | set(pod.requests)))
        keep = [resources.index(r) for r in self._resources]
        used: Matrix = np.zeros((self._used.shape[0], len(resources)), dtype=np.int64)
        used[:, keep] = self._used
        self._resources, self._used = resources, used
        self._columns = {r: i for i, r in enumerate(resources)}
        self._sizes.clear()

    def _recount(self) -> None:
        """Usage from every pod again: node positions changed."""
        assert self._nodes is not None
        self._delta_rows.clear()
        self._delta_vecs.clear()
        names = set(self._nodes.allocatable) | {PODS} | set(self._resources)
        names.update(*(p.requests for p in self._pods.values()))
        self._resources = tuple(sorted(names))
        self._columns = {r: i for i, r in enumerate(self._resources)}
        self._sizes.clear()
        self._used, _ = usage(self._nodes, self._resources, self._pods.values())
        # Counts, not flags: a node reopens only when its last terminating pod is gone.
        counts = np.zeros(len(self._nodes.nodes), dtype=np.int64)
        rows = [self._nodes.index[p.node_name] for p in self._pods.values()
                if p.terminating and p.node_name in self._nodes.index]
        np.add.at(counts, rows, 1)
        self._terminating = counts

    def _set_groups(self, groups: tuple[PodGroupRecord, ...]) -> None:
        fresh = {f"{g.namespace}/{g.name}": g for g in groups}
        for key in self._groups.keys() | fresh.keys():
            old, new = self._groups.get(key), fresh.get(key)
            if old is not new and old != new:
                self._dirty.add(key)
        self._groups = fresh
