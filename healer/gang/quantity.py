"""Kubernetes resource quantities as integers in each resource's canonical unit."""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation

CPU = "cpu"
"""CPU, counted in millicores."""
MEMORY = "memory"
"""Memory, counted in bytes."""
PODS = "pods"
"""Pod slots on a node; every pod requests one."""
GPU = "nvidia.com/gpu"
"""NVIDIA GPUs (extended resource), counted in devices."""

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}


def parse_quantity(text: str | int | float) -> Decimal:
    """The value of a Kubernetes quantity string (``500m``, ``16Gi``, ``1e3``, ``8``)."""
    if isinstance(text, int | float):
        return Decimal(str(text))
    s = text.strip()
    try:
        for suffix, factor in _BINARY.items():
            if s.endswith(suffix):
                return Decimal(s[: -len(suffix)]) * factor
        if s and s[-1] in _DECIMAL and not s[-1].isdigit():
            # "1E3"-style exponents end in a digit, so a trailing letter is a suffix.
            return Decimal(s[:-1]) * _DECIMAL[s[-1]]
        return Decimal(s)
    except InvalidOperation as exc:
        raise ValueError(f"not a Kubernetes quantity: {text!r}") from exc


def canonical(resource: str, text: str | int | float) -> int:
    """A quantity as an integer: millicores for cpu, whole units (rounded up) for the rest.

    Rounding up matches the API server's view of requests: 0.5 bytes still needs a byte.
    """
    value = parse_quantity(text)
    if resource == CPU:
        value *= 1000
    return math.ceil(value)


def describe(resource: str, amount: int) -> str:
    """An amount in the unit people read: cores for cpu, GiB for memory, counts otherwise."""
    if resource == CPU:
        return f"{amount / 1000:g} cores"
    if resource == MEMORY:
        return f"{amount / 2**30:g}Gi"
    return str(amount)
