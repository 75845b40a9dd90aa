"""Prometheus text exposition as exporters print it (DCGM exporter, the agent's own samples)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class ExpositionSample:
    """One sample of a Prometheus text page, under the name the exporter printed."""

    name: str
    """Metric name as printed (``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``)."""
    value: float
    """Sample value."""
    labels: dict[str, str]
    """Labels as printed."""
    timestamp: float | None
    """The sample's own timestamp (seconds), if the page carries one."""


def exposition_samples(text: str) -> list[ExpositionSample]:
    """Every sample of a Prometheus text page, names as printed.

    prometheus-client's parser renames a ``counter`` sample whose name does not end in
    lower-case ``_total`` (all of DCGM's counters: ``..._VOL_TOTAL``, ``..._REPLAY_COUNTER``)
    to ``<name>_total``; the exporter's own name is the family's.
    """
    out: list[ExpositionSample] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if family.type == "counter" and name == family.name + "_total" and not family.name.endswith("_total"):
                name = family.name
            ts = float(s.timestamp) if s.timestamp is not None else None
            out.append(ExpositionSample(name, float(s.value), dict(s.labels), ts))
    return out


def gpu_labels(labels: dict[str, str]) -> dict[str, str]:
    """The exporter's labels plus the ``uuid`` / ``pci`` names the other GPU sources use."""
    if "UUID" in labels:
        labels.setdefault("uuid", labels["UUID"])
    if "pci_bus_id" in labels:
        labels.setdefault("pci", labels["pci_bus_id"])
    return labels
