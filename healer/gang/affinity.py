"""nodeSelector and required node affinity, evaluated for all nodes at once over a label index."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from healer.gang.records import NodeRecord, Requirement, SelectorOperator, SelectorTerm

Mask = npt.NDArray[np.bool_]
"""One boolean per node, in snapshot order."""

NAME_FIELD = "metadata.name"
"""The only node field ``matchFields`` may name."""


class LabelIndex:
    """Per-label-key value codes for every node, built lazily: a requirement becomes array compares."""

    def __init__(self, nodes: Sequence[NodeRecord]) -> None:
        self._nodes = nodes
        self._codes: dict[str, tuple[npt.NDArray[np.int32], dict[str, int]]] = {}
        self._names: tuple[npt.NDArray[np.int32], dict[str, int]] | None = None

    def _column(self, key: str) -> tuple[npt.NDArray[np.int32], dict[str, int]]:
        col = self._codes.get(key)
        if col is None:
            vocab: dict[str, int] = {}
            values = (n.labels.get(key) for n in self._nodes)
            codes = np.fromiter((-1 if v is None else vocab.setdefault(v, len(vocab)) for v in values),
                                dtype=np.int32, count=len(self._nodes))
            col = self._codes[key] = (codes, vocab)
        return col

    def _name_column(self) -> tuple[npt.NDArray[np.int32], dict[str, int]]:
        if self._names is None:
            vocab = {n.name: i for i, n in enumerate(self._nodes)}
            self._names = (np.arange(len(self._nodes), dtype=np.int32), vocab)
        return self._names

    def requirement(self, req: Requirement, *, field: bool = False) -> Mask:
        """Nodes that satisfy one requirement, with Kubernetes' rules for missing labels."""
        codes, vocab = self._name_column() if field else self._column(req.key)
        present = codes >= 0
        match req.operator:
            case SelectorOperator.EXISTS:
                return present
            case SelectorOperator.DOES_NOT_EXIST:
                return ~present
            case SelectorOperator.IN:
                return np.isin(codes, [vocab[v] for v in req.values if v in vocab])
            case SelectorOperator.NOT_IN:
                # A node without the label satisfies NotIn, as in kube-scheduler.
                return ~np.isin(codes, [vocab[v] for v in req.values if v in vocab])
            case SelectorOperator.GT | SelectorOperator.LT:
                return self._compare(req)
        raise ValueError(f"unknown operator {req.operator!r}")

    def _compare(self, req: Requirement) -> Mask:
        try:
            bound = int(req.values[0])
        except (IndexError, ValueError):
            return np.zeros(len(self._nodes), dtype=np.bool_)
        codes, vocab = self._column(req.key)
        by_code = np.zeros(len(vocab) + 1, dtype=np.bool_)
        for value, code in vocab.items():
            try:
                number = int(value)
            except ValueError:
                continue
            by_code[code] = number > bound if req.operator == SelectorOperator.GT else number < bound
        # Missing labels map to code -1, the extra last slot, which stays False.
        return by_code[codes]

    def term(self, term: SelectorTerm) -> Mask:
        """Nodes that satisfy every requirement of one term; an empty term matches nothing."""
        if not term.match_expressions and not term.match_fields:
            return np.zeros(len(self._nodes), dtype=np.bool_)
        mask = np.ones(len(self._nodes), dtype=np.bool_)
        for req in term.match_expressions:
            mask &= self.requirement(req)
        for req in term.match_fields:
            if req.key != NAME_FIELD:
                return np.zeros(len(self._nodes), dtype=np.bool_)
            mask &= self.requirement(req, field=True)
        return mask

    def matches(self, node_selector: Mapping[str, str], affinity: tuple[SelectorTerm, ...]) -> Mask:
        """Nodes that satisfy the nodeSelector and at least one required affinity term."""
        mask = np.ones(len(self._nodes), dtype=np.bool_)
        for key, value in node_selector.items():
            mask &= self.requirement(Requirement(key, SelectorOperator.IN, (value,)))
        if affinity:
            any_term = np.zeros(len(self._nodes), dtype=np.bool_)
            for term in affinity:
                any_term |= self.term(term)
            mask &= any_term
        return mask
