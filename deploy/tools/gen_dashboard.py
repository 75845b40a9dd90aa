"""Writes the Grafana dashboard into the Helm chart (deploy/helm/kmend/files/grafana-dashboard.json) with
Grafana's Foundation SDK (typed against Grafana's dashboard schema): `python deploy/tools/gen_dashboard.py`, then
`python deploy/tools/render_manifests.py` for the ConfigMap and the copy under deploy/monitoring/.

A test regenerates it and compares, and checks that every query names metrics kmend exports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")


def _q(expr: str, legend: str = "") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).datasource(DS)
    return q.legend_format(legend) if legend else q


def _ts(title: str, unit: str, *queries: prometheus.Dataquery, w: int = 12, desc: str = "") -> timeseries.Panel:
    p = timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(w).description(desc)
    for ref, q in zip("ABCDEFGH", queries, strict=False):
        p = p.with_target(q.ref_id(ref))
    return p


def _stat(title: str, expr: str, desc: str = "") -> stat.Panel:
    return (stat.Panel().title(title).datasource(DS).height(4).span(4).with_target(_q(expr).ref_id("A"))
            .description(desc))


def build() -> dict[str, Any]:
    """The dashboard as JSON-ready data."""
    d = (dashboard.Dashboard("kmend").uid("kmend-overview").tags(["kmend", "gpu"]).refresh("30s")
         .time("now-6h", "now").timezone("browser").editable()
         .description("GPU cluster faults found and healed by kmend")
         .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_row(dashboard.Row("Cluster health"))
         .with_panel(_stat("Open incidents", "sum(kmend_incidents_open)", "incidents open or remediating"))
         .with_panel(_stat("Quarantined nodes", "max(kmend_nodes_quarantined)", "cordoned and tainted by kmend"))
         .with_panel(_stat("Spares available", 'max(kmend_spares{state="available"})'))
         .with_panel(_stat("Plans awaiting approval",
                           'sum(kmend_healer_plans_in_state{state="awaiting_approval"})'))
         .with_panel(_stat("Breaker", "max(kmend_healer_breaker_tripped)", "1: automatic quarantines stopped"))
         .with_panel(_stat("Healer leader replicas", "sum(kmend_healer_leader)", "exactly 1 when healthy"))
         .with_panel(_ts("Incidents open by fault class", "short",
                         _q("sum by (fault_class) (kmend_incidents_open)", "{{fault_class}}")))
         .with_panel(_ts("Findings by fault class", "ops",
                         _q("sum by (fault_class) (rate(kmend_analyzer_findings_total[5m]))", "{{fault_class}}"),
                         desc="rule matches and detector verdicts (hang, straggler) per second"))
         .with_row(dashboard.Row("Healing"))
         .with_panel(_ts("Plan steps by kind and result", "ops",
                         _q("sum by (kind, result) (rate(kmend_healer_actions_total[5m]))", "{{kind}} {{result}}")))
         .with_panel(_ts("Plans by state", "short",
                         _q("sum by (state) (kmend_healer_plans_in_state)", "{{state}}")))
         .with_panel(_ts("Spare pool", "short", _q("sum by (state) (kmend_spares)", "{{state}}")))
         .with_panel(_ts("Quarantined nodes", "short", _q("max(kmend_nodes_quarantined)", "quarantined")))
         .with_row(dashboard.Row("Ingest and agents"))
         .with_panel(_ts("Signals ingested by source", "ops",
                         _q("sum by (source) (rate(kmend_ingest_signals_total[5m]))", "{{source}}")))
         .with_panel(_ts("Ingest batch latency", "s",
                         _q("histogram_quantile(0.99, sum by (le) (rate(kmend_ingest_batch_duration_seconds_bucket"
                            "[5m])))", "p99"),
                         _q("histogram_quantile(0.5, sum by (le) (rate(kmend_ingest_batch_duration_seconds_bucket"
                            "[5m])))", "p50")))
         .with_panel(_ts("Agents: signals read vs shipped", "ops",
                         _q("sum(rate(kmend_agent_signals_total[5m]))", "read"),
                         _q("sum(rate(kmend_agent_signals_shipped_total[5m]))", "shipped"),
                         _q("sum(rate(kmend_agent_signals_spooled_total[5m]))", "spooled")))
         .with_panel(_ts("Agents: spool and drops", "bytes",
                         _q("sum by (instance) (kmend_agent_spool_bytes)", "{{instance}} spool"),
                         _q("sum by (instance) (increase(kmend_agent_signals_dropped_total[10m]))",
                            "{{instance}} dropped")))
         .with_panel(_ts("Agents not looping (s since last loop)", "s",
                         _q("time() - kmend_agent_last_loop_timestamp_seconds", "{{instance}}")))
         .with_panel(_ts("Rejected batches", "ops", _q("sum(rate(kmend_ingest_rejected_batches_total[5m]))",
                                                     "rejected"))))
    data: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))
    return data


def render() -> dict[str, str]:
    """File name (under deploy/helm/kmend/files/) to its text."""
    return {"grafana-dashboard.json": json.dumps(build(), indent=2, sort_keys=True) + "\n"}


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "helm" / "kmend" / "files"
    for name, body in render().items():
        (out / name).write_text(body)
        print(f"wrote {out / name}", file=sys.stderr)
