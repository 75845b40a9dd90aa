"""The agent's own Prometheus metrics, on an explicit registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AgentMetrics:
    """Counters an operator watches to trust the agent: read, shipped, spooled, dropped, errors."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lines_read = Counter(
            "kmend_agent_lines_read_total", "Log lines and samples read, before the prefilter.",
            ["source"], registry=r)
        self.lines_filtered = Counter(
            "kmend_agent_lines_filtered_total",
            "Log lines the prefilter dropped: no fault or progress rule could match them.", ["source"], registry=r)
        self.signals_read = Counter(
            "kmend_agent_signals_total", "Signals produced after the prefilter.", ["source"], registry=r)
        self.shipped = Counter(
            "kmend_agent_signals_shipped_total", "Signals the service accepted.", registry=r)
        self.spooled = Counter(
            "kmend_agent_signals_spooled_total", "Signals written to the disk spool.", registry=r)
        self.dropped = Counter(
            "kmend_agent_signals_dropped_total",
            "Signals lost: spool over its cap (spool_full_<value>: telemetry, symptom, cause), or a batch the "
            "service refused as malformed (rejected).",
            ["reason"], registry=r)
        self.backpressure = Counter(
            "kmend_agent_backpressure_total",
            "Flushes whose lines the full spool could not keep: held in memory, read positions not advanced.",
            registry=r)
        self.source_errors = Counter(
            "kmend_agent_source_errors_total", "Exceptions raised by a source's poll.",
            ["source"], registry=r)
        self.ship_errors = Counter(
            "kmend_agent_ship_errors_total", "Failed POSTs to the service.", registry=r)
        self.source_lost = Counter(
            "kmend_agent_source_lost_total",
            "Records lost before the agent could read them (kernel ring-buffer overruns).",
            ["source"], registry=r)
        self.spool_bytes = Gauge(
            "kmend_agent_spool_bytes", "Bytes waiting in the disk spool.", registry=r)
        self.spool_batches = Gauge(
            "kmend_agent_spool_batches", "Batches waiting in the disk spool.", registry=r)
        self.last_loop = Gauge(
            "kmend_agent_last_loop_timestamp_seconds", "When the poll loop last completed.", registry=r)
