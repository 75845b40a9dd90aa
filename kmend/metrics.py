"""Prometheus metrics of the service, on an explicit registry (no globals)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector


class Metrics:
    """One line per metric, with help text."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # The process's CPU seconds, memory and garbage collections, as every Python exporter shows them.
        GCCollector(registry=r)
        ProcessCollector(registry=r)
        self.signals = Counter("kmend_ingest_signals_total", "Signals accepted for the first time, by source",
                               ["source"], registry=r)
        self.duplicates = Counter("kmend_ingest_duplicate_signals_total",
                                  "Signals ignored because their id was already stored", registry=r)
        self.rejected = Counter("kmend_ingest_rejected_batches_total", "Batches rejected whole as malformed",
                                registry=r)
        self.busy = Counter("kmend_ingest_busy_batches_total",
                            "Batches answered 503 (retry later): they would have waited past KMEND_INGEST_QUEUE_S",
                            registry=r)
        self.detector_errors = Counter("kmend_analyzer_detector_errors_total",
                                       "Detector evaluations (or one job's data in them) that failed; the others ran",
                                       ["detector"], registry=r)
        self.rejected_records = Counter("kmend_ingest_rejected_records_total",
                                        "Records left out of an accepted batch (values no store can hold), by route",
                                        ["route"], registry=r)
        self.batch_seconds = Histogram("kmend_ingest_batch_duration_seconds",
                                       "Time to store and analyze one batch", registry=r)
        self.findings = Counter("kmend_analyzer_findings_total", "Findings produced, by fault class",
                                ["fault_class"], registry=r)
        self.incidents_open = Gauge("kmend_incidents_open", "Incidents open or remediating, by fault class",
                                    ["fault_class"], registry=r)
        self.actions = Counter("kmend_healer_actions_total", "Plan steps run, by kind and result",
                               ["kind", "result"], registry=r)
        self.plans = Counter("kmend_healer_plans_total", "Plans created, by policy and mode",
                             ["policy", "mode"], registry=r)
        self.nodes_quarantined = Gauge("kmend_nodes_quarantined", "Nodes cordoned and tainted by kmend",
                                       registry=r)
        self.spares = Gauge("kmend_spares", "Nodes of the hot-spare pool, by state (available, in-use, unhealthy)",
                            ["state"], registry=r)
        self.breaker = Gauge("kmend_healer_breaker_tripped", "1 while the quarantine circuit breaker is tripped",
                             registry=r)
        self.leader = Gauge("kmend_healer_leader", "1 while this replica holds the healer Lease", registry=r)
        self.plans_by_state = Gauge("kmend_healer_plans_in_state",
                                    "Plans by state (awaiting_approval, running, failed, …)", ["state"], registry=r)
        self.healer_round = Gauge("kmend_healer_last_round_timestamp_seconds",
                                  "When the healer loop last completed a round (a stuck loop stops it)", registry=r)
        self.api_calls = Counter("kmend_runbook_api_calls_total", "Runbook API calls, by route and status",
                                 ["route", "status"], registry=r)

    @staticmethod
    def set_counts(gauge: Gauge, counts: Mapping[str, int], labels: Iterable[str] = ()) -> None:
        """Set a one-label gauge to `counts`, dropping labels no longer counted (`labels` are always shown, at 0)."""
        gauge.clear()
        for label in {*labels, *counts}:
            gauge.labels(label).set(counts.get(label, 0))
