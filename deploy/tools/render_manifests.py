"""Renders the Helm chart (deploy/helm/kmend) into the raw manifests under deploy/ with Helm's own template
engine (the helm-python-sdk binding of Helm's Go SDK), so the chart is the one source of both:
`python deploy/tools/render_manifests.py` rewrites them, tests/test_helm_chart.py fails when they drift."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
CHART = DEPLOY / "helm" / "kmend"
RAW_VALUES = DEPLOY / "tools" / "raw-values.yaml"
RELEASE, NAMESPACE = "kmend", "kmend-system"
HEADER = ("# Rendered from the Helm chart deploy/helm/kmend with deploy/tools/raw-values.yaml by\n"
          "# `python deploy/tools/render_manifests.py`: edit the chart, not this file.\n")
# Helm's install order, so that a `kubectl apply -f` of one file creates what later objects need first.
KIND_ORDER = ["Namespace", "NetworkPolicy", "ServiceAccount", "Secret", "ConfigMap", "PersistentVolumeClaim",
              "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service", "DaemonSet", "Deployment",
              "PodDisruptionBudget", "ServiceMonitor", "PodMonitor", "PrometheusRule"]


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE,
           namespace: str = NAMESPACE) -> list[str]:
    """The chart's objects as YAML documents (comments kept), in install order."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=release, namespace=namespace, is_install=True)
    docs = []
    for path in sorted(out):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in re.split(r"(?m)^---[ \t]*$\n?", out[path]):
            if yaml.safe_load(doc):
                docs.append(doc.strip("\n") + "\n")
    return sorted(docs, key=lambda d: KIND_ORDER.index(yaml.safe_load(d)["kind"]))


def objects(values: dict[str, Any] | None = None, **kw: Any) -> list[dict[str, Any]]:
    """The chart's objects, parsed."""
    return [yaml.safe_load(d) for d in render(values, **kw)]


def _raw_file(obj: dict[str, Any]) -> str:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if kind in ("ServiceMonitor", "PodMonitor"):
        return "monitoring/servicemonitor.yaml"
    if kind == "PrometheusRule":
        return "monitoring/prometheus-rule.yaml"
    if kind == "ConfigMap" and name.endswith("-grafana-dashboard"):
        return "monitoring/grafana-dashboard-configmap.yaml"
    if name == f"{RELEASE}-agent":
        return "agent/daemonset.yaml" if kind in ("DaemonSet", "NetworkPolicy") else "agent/rbac.yaml"
    return "service/kmend.yaml"


def raw_manifests() -> dict[str, str]:
    """Path under deploy/ to the text the chart renders there."""
    values = yaml.safe_load(RAW_VALUES.read_text())
    files: dict[str, list[str]] = {}
    for doc in render(values):
        files.setdefault(_raw_file(yaml.safe_load(doc)), []).append(doc)
    out = {path: HEADER + "---\n".join(docs) for path, docs in files.items()}
    # The dashboard as a file for Grafana's import dialog, the same JSON the ConfigMap carries.
    out["monitoring/grafana-dashboard.json"] = (CHART / "files" / "grafana-dashboard.json").read_text()
    return out


if __name__ == "__main__":
    for rel, text in raw_manifests().items():
        (DEPLOY / rel).write_text(text)
        print(f"wrote deploy/{rel}", file=sys.stderr)
