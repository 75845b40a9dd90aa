"""SimPods: the PodScheduling port in memory, with the API server's behaviour (see KUBERNETES-API.md).

Binding a bound or terminating pod gives 409; there is no unbind; deleting a bound pod only marks
it terminating (it keeps its resources) until ``finish_termination`` or ``tick`` past its grace
period; an unbound pod is deleted at once; evictions honour disruption budgets with 429.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from healer.cluster import ClusterError, NotFoundError, TemporaryError
from healer.gang.port import ConflictError, ObjectRef, PodChanges, PodGroupStatus, PodKey
from healer.gang.records import NodeRecord, PodGroupKind, PodGroupRecord, PodRecord, Snapshot, bound_to


@dataclass(frozen=True, slots=True)
class SimEvent:
    """An event the simulated API server recorded."""

    ref: ObjectRef
    """What it is about."""
    reason: str
    """CamelCase reason."""
    message: str
    """Message."""
    type: str
    """Normal or Warning."""


class SimPods:
    """An in-memory API server for nodes, pods and PodGroups, safe to call from several threads."""

    def __init__(self, *, clock: Callable[[], float], grace_s: float = 30.0,
                 recreate_deleted: bool = False) -> None:
        self._clock = clock
        self._grace_s = grace_s
        self._recreate = recreate_deleted
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeRecord] = {}
        self._pods: dict[tuple[str, str], PodRecord] = {}
        self._deadline: dict[tuple[str, str], float] = {}
        self._groups: dict[tuple[str, str], PodGroupRecord] = {}
        self._failures: dict[tuple[str, str], list[ClusterError]] = {}
        self._budgets: list[tuple[str, Mapping[str, str], list[int]]] = []
        self._uids = itertools.count(1)
        # Change log for ``changes``: entry i is the pod touched by change number base + i + 1.
        self._log: list[PodKey] = []
        self._log_base = 0
        self._pending: dict[PodKey, None] = {}
        self.events: list[SimEvent] = []
        """Events in the order they were emitted."""
        self.group_status: dict[tuple[str, str], PodGroupStatus] = {}
        """Last status written per PodGroup."""
        self.binds = 0
        """Successful Binding calls."""

    # Objects, as controllers and kubelets would create and change them.

    def add_node(self, node: NodeRecord) -> None:
        """Create or replace a node."""
        with self._lock:
            self._nodes[node.name] = node

    def add_pod(self, pod: PodRecord) -> PodRecord:
        """Create a pod (a UID is assigned when it has none) and return it as stored."""
        with self._lock:
            return self._create(pod)

    def add_pod_group(self, group: PodGroupRecord) -> None:
        """Create or replace a PodGroup."""
        with self._lock:
            self._groups[(group.namespace, group.name)] = group

    def pod(self, namespace: str, name: str) -> PodRecord:
        """The stored pod."""
        with self._lock:
            return self._get(namespace, name)

    def pods(self) -> tuple[PodRecord, ...]:
        """All stored pods."""
        with self._lock:
            return tuple(self._pods.values())

    def finish_pod(self, namespace: str, name: str, *, succeeded: bool = True) -> None:
        """The pod's containers exited: it holds nothing any more (phase Succeeded or Failed)."""
        del succeeded  # both phases free the node alike
        with self._lock:
            self._put(dataclasses.replace(self._get(namespace, name), finished=True))

    def finish_termination(self, namespace: str, name: str) -> None:
        """The kubelet finished a terminating pod: the object goes and frees its resources."""
        with self._lock:
            key = (namespace, name)
            if key in self._pods and self._pods[key].terminating:
                self._remove(key)

    def tick(self) -> None:
        """Remove terminating pods whose grace period has run out."""
        now = self._clock()
        with self._lock:
            for key in [k for k, t in self._deadline.items() if t <= now]:
                self._remove(key)

    def inject_bind_failure(self, namespace: str, name: str, error: ClusterError, *, times: int = 1) -> None:
        """Make the next ``times`` bindings of this pod raise ``error``."""
        with self._lock:
            self._failures.setdefault((namespace, name), []).extend([error] * times)

    def set_disruption_budget(self, namespace: str, selector: Mapping[str, str], allowed: int) -> None:
        """A PodDisruptionBudget: evictions of matching bound pods allowed before 429."""
        with self._lock:
            self._budgets.append((namespace, dict(selector), [allowed]))

    def evict_pod(self, pod: PodRecord) -> None:
        """The Eviction API: 429 while a budget allows no disruption; pending pods ignore budgets."""
        with self._lock:
            stored = self._get(pod.namespace, pod.name)
            if stored.node_name and not stored.terminating:
                for ns, selector, left in self._budgets:
                    if ns == stored.namespace and all(stored.labels.get(k) == v for k, v in selector.items()):
                        if left[0] <= 0:
                            raise TemporaryError("Cannot evict pod as it would violate the pod's "
                                                 "disruption budget.", delay=10.0)
                        left[0] -= 1
            self._delete((pod.namespace, pod.name))

    # The PodScheduling port.

    def list_pending(self, scheduler_name: str) -> Sequence[PodRecord]:
        """Unbound, non-terminating, unfinished pods for ``scheduler_name``."""
        with self._lock:
            pods = (self._pods[k] for k in self._pending)
            return [p for p in pods if p.scheduler_name == scheduler_name]

    def changes(self, cursor: str) -> PodChanges:
        """Pods touched since ``cursor`` (their latest state, or gone); everything when it is "" or expired."""
        with self._lock:
            head = str(self._log_base + len(self._log))
            nodes, groups = tuple(self._nodes.values()), tuple(self._groups.values())
            since = int(cursor) if cursor.isdigit() else -1
            if since < self._log_base:
                pods = tuple(p for p in self._pods.values() if not p.finished)
                return PodChanges(head, True, pods, (), nodes, groups)
            touched = dict.fromkeys(self._log[since - self._log_base:])
            live = [self._pods.get(k) for k in touched]
            return PodChanges(head, False, tuple(p for p in live if p is not None and not p.finished),
                              tuple(k for k, p in zip(touched, live, strict=True) if p is None or p.finished),
                              nodes, groups)

    def snapshot(self) -> Snapshot:
        """Nodes, unfinished pods and PodGroups."""
        with self._lock:
            return Snapshot(tuple(self._nodes.values()),
                            tuple(p for p in self._pods.values() if not p.finished),
                            tuple(self._groups.values()))

    def bind(self, pod: PodRecord, node: str) -> None:
        """The Binding API, including its 409s; like the API server it does not check the node exists."""
        with self._lock:
            key = (pod.namespace, pod.name)
            stored = self._get(pod.namespace, pod.name)
            queued = self._failures.get(key)
            if queued:
                raise queued.pop(0)
            if pod.uid and stored.uid != pod.uid:
                raise ConflictError(f"Operation cannot be fulfilled on pods/binding \"{pod.name}\": "
                                    f"the UID in the precondition ({pod.uid}) does not match the UID in "
                                    f"record ({stored.uid}). The object might have been deleted and then "
                                    "recreated")
            if stored.terminating:
                raise ConflictError(f"pod {pod.name} is being deleted, cannot be assigned to a host")
            if stored.node_name:
                raise ConflictError(f"pod {pod.name} is already assigned to node \"{stored.node_name}\"")
            self._put(bound_to(stored, node))
            self.binds += 1

    def delete_pod(self, pod: PodRecord) -> None:
        """Delete; a missing pod is fine, a bound one turns terminating."""
        with self._lock:
            if (pod.namespace, pod.name) in self._pods:
                self._delete((pod.namespace, pod.name))

    def emit_event(self, ref: ObjectRef, reason: str, message: str, type: str = "Normal") -> None:
        """Record an event."""
        with self._lock:
            self.events.append(SimEvent(ref, reason, message, type))

    def set_pod_group_status(self, namespace: str, name: str, kind: PodGroupKind,
                             status: PodGroupStatus) -> None:
        """Store the status; a missing PodGroup drops the write."""
        del kind  # one store holds both APIs' groups
        with self._lock:
            if (namespace, name) in self._groups:
                self.group_status[(namespace, name)] = status

    # Internals; callers hold the lock.

    def _get(self, namespace: str, name: str) -> PodRecord:
        try:
            return self._pods[(namespace, name)]
        except KeyError:
            raise NotFoundError(f'pods "{name}" not found') from None

    def _create(self, pod: PodRecord) -> PodRecord:
        stored = pod if pod.uid else dataclasses.replace(pod, uid=f"uid-{next(self._uids)}")
        self._put(stored)
        return stored

    def _put(self, pod: PodRecord) -> None:
        key = (pod.namespace, pod.name)
        self._pods[key] = pod
        if pod.node_name or pod.terminating or pod.finished:
            self._pending.pop(key, None)
        else:
            self._pending[key] = None
        self._touch(key)

    def _touch(self, key: PodKey) -> None:
        self._log.append(key)
        if len(self._log) > max(65_536, 4 * len(self._pods)):
            # Readers further behind than the kept half get a full list, as a watch gets 410 Gone.
            drop = len(self._log) // 2
            del self._log[:drop]
            self._log_base += drop

    def _delete(self, key: tuple[str, str]) -> None:
        stored = self._pods[key]
        if stored.terminating:
            return
        if not stored.node_name or stored.finished:
            # Nothing runs it, so the API server removes it without a grace period.
            self._remove(key)
            return
        self._put(dataclasses.replace(stored, terminating=True))
        self._deadline[key] = self._clock() + self._grace_s

    def _remove(self, key: tuple[str, str]) -> None:
        gone = self._pods.pop(key)
        self._pending.pop(key, None)
        self._deadline.pop(key, None)
        self._touch(key)
        if self._recreate:
            # Its controller (Job, JobSet, StatefulSet) makes a fresh pending pod of the same name.
            self._create(dataclasses.replace(gone, uid="", node_name="", terminating=False, finished=False,
                                             created=self._clock()))
