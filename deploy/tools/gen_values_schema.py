"""Writes deploy/helm/kmend/values.schema.json, which Helm checks values against before it renders anything:
`controlPlane.config` and `agent.config` take exactly the settings of `kmend serve` and `kmend agent` (from their
pydantic settings classes, so a new setting is a new value), with their types and bounds, so a misspelt or
mistyped setting fails `helm install` naming it. `python deploy/tools/gen_values_schema.py`; a test compares."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kmend.commands.agent import AgentSettings
from kmend.settings import Settings

CHART = Path(__file__).resolve().parents[1] / "helm" / "kmend"
# Set by the chart's templates from other values, or meaningless in a cluster (the simulated cluster).
CONTROL_PLANE_MANAGED = {"host", "port", "cluster", "kubeconfig", "in_cluster", "namespace", "database_url",
                         "health_check_template", "ingest_token", "operator_token", "reader_token"}
AGENT_MANAGED = {"node", "service_url", "token", "token_file", "state_dir", "pods_root", "kmsg_path", "ib_root",
                 "progress_dir", "flight_recorder_dir", "proc_root", "status_port"}
KEEP = ("type", "enum", "items", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems",
        "anyOf", "description")


def _clean(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in KEEP:
        if key not in schema:
            continue
        value = schema[key]
        if key == "items":
            value = _clean(value)
        elif key == "anyOf":
            value = [_clean(v) for v in value]
        out[key] = value
    return out


def _settings(cls: type[Any], managed: set[str]) -> dict[str, Any]:
    props = {}
    for name, prop in cls.model_json_schema()["properties"].items():
        if name in managed or name.startswith("sim_"):
            continue
        prop = _clean(prop)
        # null everywhere: kmend's own default.
        if "anyOf" not in prop:
            desc = prop.pop("description", None)
            prop = {"anyOf": [prop, {"type": "null"}], **({"description": desc} if desc else {})}
        props[name] = prop
    return {"type": "object", "additionalProperties": False, "properties": dict(sorted(props.items()))}


def build() -> dict[str, Any]:
    """The values schema: strict where kmend reads the values, open where Kubernetes objects are passed through."""
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "tokens": {"type": "object", "properties": {"create": {"type": "boolean"}}},
            "database": {"type": "object", "properties": {
                "type": {"enum": ["sqlite", "postgresql"]},
                "postgresql": {"type": "object", "properties": {"port": {"type": "integer"}}}}},
            "controlPlane": {"type": "object", "properties": {
                "replicas": {"type": "integer", "minimum": 1},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "logLevel": {"enum": ["debug", "info", "warning", "error"]},
                "logFormat": {"enum": ["text", "json"]},
                "config": _settings(Settings, CONTROL_PLANE_MANAGED)}},
            "agent": {"type": "object", "properties": {
                "enabled": {"type": "boolean"},
                "privileged": {"type": "boolean"},
                "hostPID": {"type": "boolean"},
                "metricsPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                "logLevel": {"enum": ["debug", "info", "warning", "error"]},
                "logFormat": {"enum": ["text", "json"]},
                "config": _settings(AgentSettings, AGENT_MANAGED)}},
        },
    }


def render() -> str:
    """The schema file's text."""
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    (CHART / "values.schema.json").write_text(render())
    print(f"wrote {CHART / 'values.schema.json'}", file=sys.stderr)
