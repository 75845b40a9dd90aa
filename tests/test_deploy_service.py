"""The control-plane manifest (deploy/service/kmend.yaml): the health-check Job template reaches the service as
a mounted ConfigMap named by KMEND_HEALTH_CHECK_TEMPLATE, identical to deploy/healthcheck/job-template.yaml and
renderable by the validation step. (Its ClusterRole is checked against the adapters' requests in
test_kube_healing.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from healer.steps.repair import render_health_check
from kmend.settings import Settings
from kmend.wiring import default_health_check_template

MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "service" / "kmend.yaml"


def _docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def test_the_health_check_template_is_mounted_where_the_service_reads_it(monkeypatch: Any) -> None:
    docs = _docs()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    path = Path(env["KMEND_HEALTH_CHECK_TEMPLATE"])
    [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = docs["ConfigMap"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_map["metadata"]["namespace"] == docs["Deployment"]["metadata"]["namespace"]
    text = config_map["data"][path.name]
    assert text == default_health_check_template().read_text(), "the ConfigMap copy differs from the template"
    monkeypatch.setenv("KMEND_HEALTH_CHECK_TEMPLATE", str(path))
    assert Settings().health_check_template == path
    job = render_health_check(text, name="kmend-validate-1", namespace="kmend-system", node="gpu-node-03",
                              image="dcgm:4", plan="plan-1")
    assert job["spec"]["template"]["spec"]["nodeName"] == "gpu-node-03"
