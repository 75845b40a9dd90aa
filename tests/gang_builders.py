"""Fluent builders for gang-scheduler tests: nodes, pods and pod groups in one line each."""

from __future__ import annotations

import dataclasses
from typing import Any

from healer.cluster import Taint
from healer.gang.quantity import CPU, GPU, MEMORY, PODS
from healer.gang.records import (
    POD_GROUP_LABEL,
    REQUIRED_TOPOLOGY_ANNOTATION,
    VOLCANO_GROUP_ANNOTATION,
    NodeRecord,
    PodGroupRecord,
    PodRecord,
    Requirement,
    SelectorOperator,
    SelectorTerm,
    Toleration,
    TolerationOperator,
)


class MakeNode:
    """``MakeNode("n1").gpus(8).leaf("l1").obj()``: a schedulable 8-GPU node by default."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._alloc: dict[str, int] = {CPU: 128_000, MEMORY: 1024 * 2**30, PODS: 110, GPU: 8}
        self._labels: dict[str, str] = {}
        self._taints: list[Taint] = []
        self._unschedulable = False

    def gpus(self, n: int) -> MakeNode:
        self._alloc[GPU] = n
        return self

    def resource(self, name: str, amount: int) -> MakeNode:
        self._alloc[name] = amount
        return self

    def leaf(self, leaf: str, spine: str = "s1", zone: str = "z1") -> MakeNode:
        self._labels.update({"topology.kmend.io/leaf": leaf, "topology.kmend.io/spine": spine,
                             "topology.kmend.io/zone": zone})
        return self

    def label(self, key: str, value: str) -> MakeNode:
        self._labels[key] = value
        return self

    def taint(self, key: str, value: str = "", effect: str = "NoSchedule") -> MakeNode:
        self._taints.append(Taint(key, value, effect))
        return self

    def cordoned(self) -> MakeNode:
        self._unschedulable = True
        return self

    def spare(self) -> MakeNode:
        return self.label("kmend.io/spare", "true").taint("kmend.io/spare", "true")

    def obj(self) -> NodeRecord:
        return NodeRecord(self._name, dict(self._alloc), dict(self._labels), tuple(self._taints),
                          self._unschedulable)


class MakePod:
    """``MakePod("w-0").group("pg1").gpus(8).obj()``: a pending pod for the kmend scheduler."""

    def __init__(self, name: str, namespace: str = "train") -> None:
        self._fields: dict[str, Any] = {"namespace": namespace, "name": name, "scheduler_name": "kmend",
                                         "requests": {CPU: 1000}, "labels": {}, "annotations": {},
                                         "tolerations": (), "node_selector": {}, "affinity": ()}

    def gpus(self, n: int) -> MakePod:
        self._fields["requests"] = {**self._fields["requests"], GPU: n}
        return self

    def request(self, name: str, amount: int) -> MakePod:
        self._fields["requests"] = {**self._fields["requests"], name: amount}
        return self

    def group(self, name: str) -> MakePod:
        self._fields["labels"] = {**self._fields["labels"], POD_GROUP_LABEL: name}
        return self

    def volcano_group(self, name: str) -> MakePod:
        self._fields["annotations"] = {**self._fields["annotations"], VOLCANO_GROUP_ANNOTATION: name}
        return self

    def on(self, node: str) -> MakePod:
        self._fields["node_name"] = node
        return self

    def terminating(self) -> MakePod:
        self._fields["terminating"] = True
        return self

    def scheduler(self, name: str) -> MakePod:
        self._fields["scheduler_name"] = name
        return self

    def tolerate(self, key: str = "", value: str = "", effect: str = "", exists: bool = False) -> MakePod:
        op = TolerationOperator.EXISTS if exists else TolerationOperator.EQUAL
        self._fields["tolerations"] = (*self._fields["tolerations"], Toleration(key, op, value, effect))
        return self

    def selector(self, key: str, value: str) -> MakePod:
        self._fields["node_selector"] = {**self._fields["node_selector"], key: value}
        return self

    def affinity(self, *requirements: tuple[str, str, tuple[str, ...]]) -> MakePod:
        """One required term; each requirement is (key, operator, values). Call again to OR a term."""
        term = SelectorTerm(tuple(Requirement(k, SelectorOperator(op), v) for k, op, v in requirements))
        self._fields["affinity"] = (*self._fields["affinity"], term)
        return self

    def priority(self, p: int) -> MakePod:
        self._fields["priority"] = p
        return self

    def created(self, t: float) -> MakePod:
        self._fields["created"] = t
        return self

    def annotate(self, key: str, value: str) -> MakePod:
        self._fields["annotations"] = {**self._fields["annotations"], key: value}
        return self

    def obj(self) -> PodRecord:
        return PodRecord(**self._fields)


def gang(name: str, n: int, gpus: int = 8, **kw: Any) -> list[PodRecord]:
    """``n`` identical pending pods of group ``name``, named ``name-0`` .. ``name-{n-1}``."""
    pods = [MakePod(f"{name}-{i}").group(name).gpus(gpus).obj() for i in range(n)]
    return [dataclasses.replace(p, **kw) for p in pods]


class MakePodGroup:
    """``MakePodGroup("pg1").min_member(2).obj()``."""

    def __init__(self, name: str, namespace: str = "train") -> None:
        self._fields: dict[str, Any] = {"namespace": namespace, "name": name, "annotations": {},
                                        "min_resources": {}}

    def min_member(self, n: int) -> MakePodGroup:
        self._fields["min_member"] = n
        return self

    def min_resources(self, **amounts: int) -> MakePodGroup:
        self._fields["min_resources"] = {k.replace("_", "/").replace("nvidia/", "nvidia.com/"): v
                                         for k, v in amounts.items()}
        return self

    def timeout(self, seconds: float) -> MakePodGroup:
        self._fields["schedule_timeout_seconds"] = seconds
        return self

    def created(self, t: float) -> MakePodGroup:
        self._fields["created"] = t
        return self

    def required_topology(self, level: str) -> MakePodGroup:
        self._fields["annotations"] = {REQUIRED_TOPOLOGY_ANNOTATION: level}
        return self

    def obj(self) -> PodGroupRecord:
        return PodGroupRecord(**self._fields)


def rack(leaf: str, n: int, spine: str = "s1", zone: str = "z1",
         prefix: str | None = None) -> list[NodeRecord]:
    """``n`` 8-GPU nodes in one leaf."""
    return [MakeNode(f"{prefix or leaf}-n{i}").leaf(leaf, spine, zone).obj() for i in range(n)]
