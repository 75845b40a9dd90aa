"""SimWorkloads: pods, owners, evictions and ConfigMaps in memory, behaving like the API server.

Honours ../shared/KUBERNETES-API.md: evicting a pod guarded by a PodDisruptionBudget that allows no
disruption is refused with 429; deleting or evicting a bound pod only makes it terminating until its
grace period ends; pending pods ignore budgets and go at once; creates of existing objects are no-ops
(the adapter's reading of 409 AlreadyExists). Between calls the simulated cluster runs what a real
one runs (``tick``): kubelets finish terminating pods, controllers (Job, PyTorchJob, JobSet, Volcano)
recreate their pods, and a scheduler binds pending pods to schedulable nodes whose taints they tolerate.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from healer.cluster import NotFoundError, PermanentError, TemporaryError
from healer.workloads import ObjectKey, OwnerRef, PodInfo
from sim.cluster import OnChange, SimCluster

RECREATING_KINDS = frozenset({"Job", "PyTorchJob", "Job.batch.volcano.sh"})
"""Owner kinds whose controller recreates a pod that is gone (sim keys Volcano's Job apart)."""
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""Label on a JobSet's child Jobs and pods naming the JobSet."""
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
"""API version of JobSet."""
UNHEALTHY_ANNOTATION = "sim.kmend.io/unhealthy"
"""Annotation on a simulated node that makes its health check fail."""
SPARE_FOR_ANNOTATION = "kmend.io/spare-for"
"""Annotation on a spare handed to a job: ``<namespace>/<job>`` (the sim scheduler prefers it)."""


@dataclass
class _Pod:
    info: PodInfo
    gpus: int = 8
    tolerations: tuple[tuple[str, str], ...] = ()
    """(key, effect) pairs tolerated; key ``*`` tolerates everything."""
    node_selector: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None
    last_node: str = ""


def _owner_kind(o: OwnerRef) -> str:
    return "Job.batch.volcano.sh" if o.api_version.startswith("batch.volcano.sh") else o.kind


class SimWorkloads:
    """In-memory implementation of the Workloads port over a SimCluster's nodes (thread-safe)."""

    def __init__(self, cluster: SimCluster, *, clock: Callable[[], float] = time.time,
                 on_change: OnChange | None = None, scheduler: bool = True) -> None:
        self.cluster = cluster
        self.clock = clock
        self.on_change = on_change
        self.scheduler = scheduler
        self._lock: threading.RLock = cluster.lock
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        self._budgets: list[tuple[str, dict[str, str], int]] = []
        self._uids = itertools.count(1)
        self.binds = 0
        """Pods bound by the simulated scheduler."""

    # -- building the simulated world ---------------------------------------------

    def add_pod(self, namespace: str, name: str, *, node: str = "", gpus: int = 8,
                labels: Mapping[str, str] | None = None, annotations: Mapping[str, str] | None = None,
                owner: OwnerRef | None = None, tolerations: Sequence[tuple[str, str]] = (),
                node_selector: Mapping[str, str] | None = None) -> PodInfo:
        """Create a pod as a controller would (bound when `node` is given) and return it."""
        manifest = _manifest(name, labels or {}, annotations or {}, gpus, tolerations, node_selector or {})
        with self._lock:
            info = PodInfo(namespace, name, f"uid-{next(self._uids)}", node, dict(labels or {}),
                           dict(annotations or {}), (owner,) if owner else (), False,
                           "Running" if node else "Pending", self.clock(), manifest)
            self._pods[(namespace, name)] = _Pod(info, gpus, tuple(tolerations), dict(node_selector or {}),
                                                 last_node=node)
            if owner is not None:
                key = ObjectKey(owner.api_version, owner.kind, namespace, owner.name)
                self._objects.setdefault(key, _with_meta(key, {}, f"uid-{next(self._uids)}"))
            return info

    def add_object(self, key: ObjectKey, manifest: Mapping[str, Any]) -> None:
        """Create an object (a PyTorchJob, a JobSet, a child Job) without recording an action."""
        with self._lock:
            self._objects[key] = _with_meta(key, dict(manifest), f"uid-{next(self._uids)}")

    def set_disruption_budget(self, namespace: str, selector: Mapping[str, str], min_available: int) -> None:
        """A PodDisruptionBudget: evictions keep at least `min_available` matching pods running."""
        with self._lock:
            self._budgets.append((namespace, dict(selector), min_available))

    def finish_termination(self, namespace: str, name: str) -> None:
        """The kubelet finished a terminating pod early."""
        with self._lock:
            p = self._pods.get((namespace, name))
            if p and p.info.terminating:
                p.deadline = self.clock()
            self.tick()

    def objects(self, kind: str | None = None) -> list[tuple[ObjectKey, Mapping[str, Any]]]:
        """Stored objects (ConfigMaps, Commands, jobs), optionally of one kind."""
        with self._lock:
            return [(k, v) for k, v in self._objects.items() if kind is None or k.kind == kind]

    # -- the cluster running between calls ---------------------------------------------

    def tick(self) -> None:
        """Finish terminating pods past their grace period, recreate owned pods, bind pending ones."""
        with self._lock:
            now = self.clock()
            for key, p in list(self._pods.items()):
                if p.info.terminating and p.deadline is not None and p.deadline <= now:
                    del self._pods[key]
                    self._recreate(p)
            self._run_health_checks()
            if self.scheduler:
                self._schedule()

    def _recreate(self, gone: _Pod) -> None:
        owner = gone.info.controller
        if owner is None or _owner_kind(owner) not in RECREATING_KINDS:
            return
        if self._owner_object(gone.info.namespace, owner) is None:
            return  # its owner was deleted: nothing recreates it
        info = replace(gone.info, uid=f"uid-{next(self._uids)}", node="", terminating=False, phase="Pending",
                       created=self.clock())
        self._pods[(info.namespace, info.name)] = replace(gone, info=info, deadline=None)

    def _owner_object(self, namespace: str, owner: OwnerRef) -> dict[str, Any] | None:
        return self._objects.get(ObjectKey(owner.api_version, owner.kind, namespace, owner.name))

    def _schedule(self) -> None:
        pending = sorted((p for p in self._pods.values() if not p.info.node and not p.info.terminating),
                         key=lambda p: p.info.name)
        if not pending:
            return
        nodes = {n.name: n for n in self.cluster.list_nodes()}
        used: dict[str, int] = {}
        for p in self._pods.values():
            if p.info.node:
                used[p.info.node] = used.get(p.info.node, 0) + p.gpus
        for p in pending:
            job = f"{p.info.namespace}/{_job_name(p.info)}"
            fits = [n for n in nodes.values() if self._fits(p, n, used)]
            if not fits:
                continue
            # Prefer the spare handed to this job, then the node the pod ran on, then the first that fits.
            fits.sort(key=lambda n: (n.annotations.get(SPARE_FOR_ANNOTATION) != job, n.name != p.last_node,
                                     n.name))
            target = fits[0].name
            used[target] = used.get(target, 0) + p.gpus
            p.info = replace(p.info, node=target, phase="Running")
            p.last_node = target
            self.binds += 1

    def _fits(self, p: _Pod, n: Any, used: Mapping[str, int]) -> bool:
        if n.unschedulable or not n.ready:
            return False
        gpus = int(n.labels.get("nvidia.com/gpu.count", "8"))
        if used.get(n.name, 0) + p.gpus > gpus:
            return False
        if any(n.labels.get(k) != v for k, v in p.node_selector.items()):
            return False
        for t in n.taints:
            if t.effect in ("NoSchedule", "NoExecute") and not any(
                    k == "*" or (k == t.key and e in ("", t.effect)) for k, e in p.tolerations):
                return False
        return True

    # -- the Workloads port -------------------------------------------------------------

    def list_pods(self, *, namespace: str | None = None, node: str | None = None,
                  selector: Mapping[str, str] | None = None) -> Sequence[PodInfo]:
        with self._lock:
            self.tick()
            out = []
            for p in self._pods.values():
                i = p.info
                if namespace is not None and i.namespace != namespace:
                    continue
                if node is not None and i.node != node:
                    continue
                if selector and any(i.labels.get(k) != v for k, v in selector.items()):
                    continue
                out.append(i)
            return sorted(out, key=lambda i: (i.namespace, i.name))

    def pods_on_node(self, node: str) -> Sequence[PodInfo]:
        return self.list_pods(node=node)

    def evict_pod(self, namespace: str, name: str, grace_s: int) -> None:
        with self._lock:
            self.tick()
            p = self._pods.get((namespace, name))
            if p is None or p.info.terminating:
                return
            if p.info.node:
                for ns, sel, min_available in self._budgets:
                    if ns != namespace or any(p.info.labels.get(k) != v for k, v in sel.items()):
                        continue
                    healthy = sum(1 for q in self._pods.values() if q.info.namespace == ns and q.info.node
                                  and not q.info.terminating and all(q.info.labels.get(k) == v
                                                                      for k, v in sel.items()))
                    if healthy - 1 < min_available:
                        raise TemporaryError("429 Too Many Requests: Cannot evict pod as it would violate the "
                                             "pod's disruption budget.", delay=5.0)
            self._delete(p, grace_s, "evict_pod")

    def delete_pod(self, namespace: str, name: str, grace_s: int | None = None) -> None:
        with self._lock:
            self.tick()
            p = self._pods.get((namespace, name))
            if p is not None and not p.info.terminating:
                self._delete(p, 30 if grace_s is None else grace_s, "delete_pod")

    def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> None:
        with self._lock:
            meta = manifest.get("metadata", {})
            name = str(meta["name"])
            if (namespace, name) in self._pods:
                return
            spec = manifest.get("spec", {})
            gpus = 0
            for c in spec.get("containers", []):
                gpus += int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            tol = tuple((str(t.get("key", "*") if t.get("operator") != "Exists" or t.get("key") else "*"),
                         str(t.get("effect", ""))) for t in spec.get("tolerations", []))
            owners = tuple(OwnerRef(o["apiVersion"], o["kind"], o["name"], bool(o.get("controller")))
                           for o in meta.get("ownerReferences", []))
            info = PodInfo(namespace, name, f"uid-{next(self._uids)}", str(spec.get("nodeName", "")),
                           dict(meta.get("labels", {})), dict(meta.get("annotations", {})), owners, False,
                           "Pending", self.clock(), dict(manifest))
            self._pods[(namespace, name)] = _Pod(info, gpus, tol, dict(spec.get("nodeSelector", {})))
            self._changed("create_pod", f"{namespace}/{name}")
            self.tick()

    def get_object(self, key: ObjectKey) -> Mapping[str, Any] | None:
        with self._lock:
            self.tick()
            obj = self._objects.get(key)
            return dict(obj) if obj is not None else None

    def create_object(self, key: ObjectKey, manifest: Mapping[str, Any]) -> None:
        with self._lock:
            if key in self._objects:
                return
            if not key.name:
                raise PermanentError(f"422 Unprocessable Entity: {key.kind}.metadata.name: Required value")
            target = manifest.get("target") or {}
            if key.kind == "Command" and not all(target.get(f) for f in ("apiVersion", "kind", "name", "uid")):
                # Volcano's CRD schema: the target is a whole OwnerReference.
                raise PermanentError(f"422 Unprocessable Entity: {key.kind} {key.name}: target.uid: Required value")
            self._objects[key] = _with_meta(key, dict(manifest), f"uid-{next(self._uids)}")
            self._changed("create_object", str(key))
            self._run_controllers(key)

    def delete_object(self, key: ObjectKey) -> None:
        with self._lock:
            obj = self._objects.pop(key, None)
            if obj is None:
                return
            self._changed("delete_object", str(key))
            for p in list(self._pods.values()):
                if any(o.kind == key.kind and o.name == key.name for o in p.info.owners) \
                        and p.info.namespace == key.namespace and not p.info.terminating:
                    self._delete(p, 30, None)
            jobset = obj.get("metadata", {}).get("labels", {}).get(JOBSET_LABEL)
            if key.kind == "Job" and jobset and ObjectKey(JOBSET_API, "JobSet", key.namespace, jobset) in self._objects:
                # The JobSet controller recreates a child Job that is missing.
                self._objects[key] = _with_meta(key, obj, f"uid-{next(self._uids)}")

    def annotate(self, key: ObjectKey, annotations: Mapping[str, str | None]) -> None:
        with self._lock:
            if key.kind == "Pod":
                p = self._pods.get((key.namespace, key.name))
                if p is None:
                    raise NotFoundError(f'pods "{key.name}" not found')
                merged = _merge(p.info.annotations, annotations)
                if merged != dict(p.info.annotations):
                    p.info = replace(p.info, annotations=merged)
                    self._changed("annotate", str(key))
                return
            obj = self._objects.get(key)
            if obj is None:
                raise NotFoundError(f'{key.kind.lower()}s "{key.name}" not found')
            meta = obj.setdefault("metadata", {})
            merged = _merge(meta.get("annotations", {}), annotations)
            if merged != meta.get("annotations", {}):
                meta["annotations"] = merged
                self._changed("annotate", str(key))

    def apply_config_map(self, namespace: str, name: str, data: Mapping[str, str],
                         labels: Mapping[str, str] | None = None) -> None:
        with self._lock:
            key = ObjectKey("v1", "ConfigMap", namespace, name)
            obj = self._objects.get(key)
            if obj is None:
                obj = _with_meta(key, {"data": {}}, f"uid-{next(self._uids)}")
                obj["metadata"]["labels"] = dict(labels or {})
            merged = {**obj.get("data", {}), **data}
            if key in self._objects and merged == obj.get("data"):
                return
            obj["data"] = merged
            self._objects[key] = obj
            self._changed("apply_config_map", f"{namespace}/{name}")

    # -- persistence (sim.world) ---------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The whole simulated state, for a file-backed world."""
        with self._lock:
            pods = [{"info": _info_json(p.info), "gpus": p.gpus, "tol": [list(t) for t in p.tolerations],
                     "sel": p.node_selector, "deadline": p.deadline, "last": p.last_node}
                    for p in self._pods.values()]
            objs = [[k.api_version, k.kind, k.namespace, k.name, v] for k, v in self._objects.items()]
            return {"pods": pods, "objects": objs, "budgets": [list(b) for b in self._budgets],
                    "uid": next(self._uids)}

    def load_json(self, d: dict[str, Any]) -> None:
        """Replace the state with one written by ``to_json``."""
        with self._lock:
            self._pods = {}
            for p in d["pods"]:
                info = _info_from_json(p["info"])
                self._pods[(info.namespace, info.name)] = _Pod(info, p["gpus"], tuple((a, b) for a, b in p["tol"]),
                                                               dict(p["sel"]), p["deadline"], p["last"])
            self._objects = {ObjectKey(*o[:4]): o[4] for o in d["objects"]}
            self._budgets = [(b[0], dict(b[1]), int(b[2])) for b in d["budgets"]]
            self._uids = itertools.count(int(d["uid"]))

    # -- internals ------------------------------------------------------------------------------

    def _delete(self, p: _Pod, grace_s: int, op: str | None) -> None:
        i = p.info
        if not i.node or grace_s <= 0:
            del self._pods[(i.namespace, i.name)]
            self._recreate(p)
        else:
            p.info = replace(i, terminating=True)
            p.deadline = self.clock() + grace_s
        if op:
            self._changed(op, f"{i.namespace}/{i.name}")

    def _run_health_checks(self) -> None:
        for key, obj in self._objects.items():
            node = obj.get("metadata", {}).get("labels", {}).get("kmend.io/health-check")
            if key.kind == "Job" and node and not obj.get("status"):
                # The health check finishes at once: it fails on a node marked unhealthy for the simulation.
                info = {n.name: n for n in self.cluster.list_nodes()}.get(node)
                bad = info is None or info.annotations.get(UNHEALTHY_ANNOTATION) == "true"
                obj["status"] = {"failed": 1} if bad else {"succeeded": 1}

    def _run_controllers(self, key: ObjectKey) -> None:
        if key.kind == "Command" and key.api_version.startswith("bus.volcano.sh"):
            cmd = self._objects.pop(key)  # the Volcano controller consumes the command
            target = cmd.get("target", {})
            if cmd.get("action") == "RestartJob":
                for p in list(self._pods.values()):
                    o = p.info.controller
                    if o and o.name == target.get("name") and _owner_kind(o) == "Job.batch.volcano.sh" \
                            and not p.info.terminating:
                        self._delete(p, 30, None)

    def _changed(self, op: str, target: str) -> None:
        if self.on_change is not None:
            self.on_change(op, target)


def _job_name(i: PodInfo) -> str:
    for label in ("kmend.io/job", "training.kubeflow.org/job-name", "jobset.sigs.k8s.io/jobset-name",
                  "volcano.sh/job-name", "batch.kubernetes.io/job-name", "scheduling.x-k8s.io/pod-group"):
        if label in i.labels:
            return i.labels[label]
    return i.name


def _merge(current: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    out = dict(current)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _with_meta(key: ObjectKey, manifest: dict[str, Any], uid: str) -> dict[str, Any]:
    meta = dict(manifest.get("metadata", {}))
    meta.update({"name": key.name, "namespace": key.namespace, "uid": uid})
    return {**manifest, "apiVersion": key.api_version, "kind": key.kind, "metadata": meta}


def _manifest(name: str, labels: Mapping[str, str], annotations: Mapping[str, str], gpus: int,
              tolerations: Sequence[tuple[str, str]], selector: Mapping[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": dict(labels), "annotations": dict(annotations)},
            "spec": {"containers": [{"name": "trainer", "image": "trainer:latest",
                                     "resources": {"limits": {"nvidia.com/gpu": gpus}}}],
                     "tolerations": [{"key": k, "operator": "Exists", "effect": e} for k, e in tolerations],
                     "nodeSelector": dict(selector)}}


def _info_json(i: PodInfo) -> dict[str, Any]:
    return {"ns": i.namespace, "name": i.name, "uid": i.uid, "node": i.node, "labels": dict(i.labels),
            "ann": dict(i.annotations), "owners": [[o.api_version, o.kind, o.name, o.controller] for o in i.owners],
            "term": i.terminating, "phase": i.phase, "created": i.created, "manifest": dict(i.manifest)}


def _info_from_json(d: dict[str, Any]) -> PodInfo:
    return PodInfo(d["ns"], d["name"], d["uid"], d["node"], d["labels"], d["ann"],
                   tuple(OwnerRef(*o) for o in d["owners"]), d["term"], d["phase"], d["created"], d["manifest"])
