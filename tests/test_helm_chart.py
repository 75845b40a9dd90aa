"""The Helm chart (deploy/helm/kmend), rendered by Helm's own engine: every object passes `kubernetes-validate
--strict` for Kubernetes 1.30 and 1.37, the control plane meets Pod Security `restricted`, the agent gets only the
privileges it documents, every KMEND_* setting has a value that kmend parses, mistakes in values fail in one line,
and the raw manifests under deploy/ are exactly what the chart renders."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kmend.commands.agent import AgentSettings
from kmend.settings import Settings
from tests.conftest import REPO
from tests.pod_security import baseline_violations, restricted_violations

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is a dev dependency")
TOOLS = runpy.run_path(str(REPO / "deploy" / "tools" / "render_manifests.py"))
CHART = REPO / "deploy" / "helm" / "kmend"
VALIDATE = str(Path(sys.executable).parent / "kubernetes-validate")
if not Path(VALIDATE).exists():
    VALIDATE = shutil.which("kubernetes-validate") or VALIDATE
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # Prometheus Operator CRDs: no upstream schema
POSTGRES = {"database": {"type": "postgresql",
                         "postgresql": {"host": "pg.db.svc", "user": "kmend", "database": "kmend",
                                        "passwordSecret": {"name": "kmend-pg", "key": "password"}}},
            "controlPlane": {"replicas": 2, "config": {"require_approval": True, "hang_k": 3.0,
                                                       "token_review": True, "token_review_readers": ["sre"]}},
            "tokens": {"operator": {"value": "op-token-0123456789"}},
            "monitoring": {"prometheusOperator": {"enabled": True, "labels": {"release": "prom"}}}}
UNPRIVILEGED_AGENT = {"agent": {"privileged": False, "config": {"kernel": "file", "gpu_reset": False}}}


def _objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    objs: list[dict[str, Any]] = TOOLS["objects"](values)
    return objs


def _one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    [obj] = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return obj


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("values", [None, POSTGRES, UNPRIVILEGED_AGENT], ids=["defaults", "postgresql",
                                                                             "unprivileged-agent"])
@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_every_rendered_object_passes_kubernetes_validate_strict(values: dict[str, Any] | None, version: str,
                                                                 tmp_path: Path) -> None:
    objs = _objects(values)
    files = []
    for i, obj in enumerate(objs):
        files.append(tmp_path / f"{i:02d}-{obj['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(obj))
    out = subprocess.run([VALIDATE, "--strict", "-k", version, *map(str, files)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    said = out.stdout + out.stderr
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        expected = f"Couldn't find schema for kind {kind}" if kind in CRD_KINDS else \
            f"passed for resource {kind.lower()}/{name}"
        assert expected in said, said
    assert "ERROR" not in said


def test_default_install_has_every_part() -> None:
    objs = _objects()
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert kinds >= {("Deployment", "kmend"), ("DaemonSet", "kmend-agent"), ("Service", "kmend"),
                     ("ClusterRole", "kmend"), ("ClusterRole", "kmend-agent"),
                     ("NetworkPolicy", "kmend"), ("NetworkPolicy", "kmend-agent"),
                     ("ConfigMap", "kmend-health-check"), ("ConfigMap", "kmend-grafana-dashboard"),
                     ("PersistentVolumeClaim", "kmend-data"), ("Secret", "kmend-ingest"),
                     ("Secret", "kmend-operator"), ("Secret", "kmend-reader")}
    # One SQLite replica: no budget (it would block every drain) and no Prometheus Operator objects without CRDs.
    assert not {o["kind"] for o in objs} & ({"PodDisruptionBudget"} | CRD_KINDS)
    tokens = [o["data"]["token"] for o in objs if o["kind"] == "Secret"]
    assert len(set(tokens)) == 3 and all(len(t) == 56 for t in tokens)  # 40 random characters, base64
    lint = helm.lint(str(CHART))
    assert lint["errors"] == [] and not [m for m in lint["messages"] if m["severity"] > 1], lint


def test_control_plane_meets_pod_security_restricted() -> None:
    for values in (None, POSTGRES):
        pod = _one(_objects(values), "Deployment")["spec"]["template"]["spec"]
        assert restricted_violations(pod) == []
        [container] = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["securityContext"]["runAsUser"] != 0


def test_the_checker_sees_what_the_agent_needs_beyond_restricted() -> None:
    """The agent is not restricted, and says exactly why: each privilege is one the agent documents."""
    pod = _one(_objects(), "DaemonSet")["spec"]["template"]["spec"]
    assert set(baseline_violations(pod)) == {
        "hostPID: true", "agent: privileged",
        *(f"hostPath volume {v}" for v in ("pods", "varlog", "kmsg", "sys", "progress", "flight-recorder", "state"))}
    # Without GPU resets and /dev/kmsg: no privileged container, only DAC_READ_SEARCH and SYS_PTRACE on top of none.
    pod = _one(_objects(UNPRIVILEGED_AGENT), "DaemonSet")["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert "privileged" not in sc and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH", "SYS_PTRACE"]}
    assert "kmsg" not in {v["name"] for v in pod["volumes"]}
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["KMEND_AGENT_KERNEL"] == "file" and env["KMEND_AGENT_GPU_RESET"] == "false"


def test_postgresql_install() -> None:
    objs = _objects(POSTGRES)
    dep = _one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    env = _env(pod["containers"][0])
    url = env["KMEND_DATABASE_URL"]["value"]
    assert url == "postgresql+psycopg://kmend@pg.db.svc:5432/kmend?sslmode=prefer"  # password: PGPASSWORD
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "kmend-pg", "key": "password"}
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert env["KMEND_REPLICATED"]["value"] == "true"  # two replicas: each ingests, the Lease holder correlates
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objs}
    assert "data" not in {v["name"] for v in pod["volumes"]}
    pdb = _one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # The given operator token is used; the others are generated.
    import base64

    assert base64.b64decode(_one(objs, "Secret", "kmend-operator")["data"]["token"]) == b"op-token-0123456789"
    # TokenReview on: the binding to system:auth-delegator comes with it (and only then).
    assert _one(objs, "ClusterRoleBinding", "kmend-tokenreview")["roleRef"]["name"] == "system:auth-delegator"
    assert not [o for o in _objects() if o["metadata"]["name"] == "kmend-tokenreview"]
    mon = _one(objs, "ServiceMonitor")
    assert mon["metadata"]["labels"]["release"] == "prom"
    assert mon["spec"]["endpoints"][0]["bearerTokenSecret"]["name"] == "kmend-reader"
    rules = _one(objs, "PrometheusRule")["spec"]["groups"]
    assert sum(len(g["rules"]) for g in rules) >= 10


def _settings_from(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch, prefix: str) -> dict[str, str]:
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    for name in list(os.environ):
        if name.startswith(prefix):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.mark.parametrize("values", [None, POSTGRES], ids=["defaults", "postgresql"])
def test_every_service_setting_has_a_value_kmend_parses(values: dict[str, Any] | None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    container = _one(_objects(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = _settings_from(container, monkeypatch, "KMEND_")
    names = set(_env(container))
    fields = {f"KMEND_{f.upper()}" for f in Settings.model_fields}
    # Fault injection and the simulated cluster are for tests and demos, not for a cluster install; in the
    # cluster the ServiceAccount replaces a kubeconfig.
    wanted = {f for f in fields if not f.startswith("KMEND_SIM_")} - {"KMEND_KUBECONFIG"}
    configurable = {f"KMEND_{k.upper()}" for k in yaml.safe_load((CHART / "values.yaml").read_text())
                    ["controlPlane"]["config"]}
    assert wanted - names - configurable == set(), "settings the chart cannot set"
    assert {n for n in names if n.startswith("KMEND_")} - fields == {"KMEND_LOG_LEVEL", "KMEND_LOG_FORMAT"}
    for tok in ("INGEST", "OPERATOR", "READER"):
        monkeypatch.setenv(f"KMEND_{tok}_TOKEN", f"token-{tok}")
    s = Settings()  # every rendered value parses
    assert s.cluster == "kube" and s.in_cluster and s.host == "0.0.0.0" and s.namespace == "kmend-system"
    assert s.max_batch_bytes == 32 * 1024 * 1024 and s.correlation_window_s == 1200.0
    if values is POSTGRES:
        assert s.require_approval is True and s.hang_k == 3.0 and s.token_review_readers == ["sre"]
        assert env["KMEND_TOKEN_REVIEW"] == "true"


def test_every_agent_setting_has_a_value_the_agent_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    container = _one(_objects(), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    _settings_from(container, monkeypatch, "KMEND_AGENT_")
    names = set(_env(container))
    fields = {f"KMEND_AGENT_{f.upper()}" for f in AgentSettings.model_fields}
    configurable = {f"KMEND_AGENT_{k.upper()}" for k in yaml.safe_load((CHART / "values.yaml").read_text())
                    ["agent"]["config"]}
    # NODE comes from the downward API as NODE_NAME; TOKEN from the mounted Secret (TOKEN_FILE).
    assert fields - names - configurable - {"KMEND_AGENT_NODE", "KMEND_AGENT_TOKEN"} == set()
    assert {n for n in names if n.startswith("KMEND_AGENT_")} <= fields
    monkeypatch.setenv("NODE_NAME", "gpu-node-01")
    s = AgentSettings()
    assert s.service_url == "http://kmend.kmend-system.svc:8080" and s.spool_max_bytes == 256 * 1024 * 1024
    assert s.kernel == "kmsg" and s.gpu_reset and s.stacks and s.node == "gpu-node-01"


@pytest.mark.parametrize(("values", "message"), [
    ({"controlPlane": {"replicas": 3}}, "controlPlane.replicas=3 needs database.type=postgresql"),
    ({"database": {"type": "mysql"}}, "at '/database/type': value must be one of 'sqlite', 'postgresql'"),
    ({"database": {"type": "postgresql"}}, "database.type=postgresql needs database.postgresql.host"),
    ({"agent": {"privileged": False}}, "agent.privileged=false cannot open /dev/kmsg"),
    ({"agent": {"privileged": False, "config": {"kernel": "file"}}}, "agent.privileged=false cannot reset GPUs"),
])
def test_mistakes_in_values_fail_in_one_line_naming_the_value(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        _objects(values)
    assert message in str(err.value)


def test_raw_manifests_are_the_rendered_chart() -> None:
    for rel, text in TOOLS["raw_manifests"]().items():
        assert (REPO / "deploy" / rel).read_text() == text, (
            f"deploy/{rel} differs from the chart: run python deploy/tools/render_manifests.py")


def test_the_agent_reaches_the_service_with_the_token_the_service_expects() -> None:
    objs = _objects()
    dep = _one(objs, "Deployment")["spec"]["template"]["spec"]
    ds = _one(objs, "DaemonSet")["spec"]["template"]["spec"]
    svc = _one(objs, "Service")
    url = _env(ds["containers"][0])["KMEND_AGENT_SERVICE_URL"]["value"]
    assert url == f"http://{svc['metadata']['name']}.kmend-system.svc:{svc['spec']['ports'][0]['port']}"
    assert svc["spec"]["selector"].items() <= _one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    ingest = _env(dep["containers"][0])["KMEND_INGEST_TOKEN"]["valueFrom"]["secretKeyRef"]
    [token_vol] = [v for v in ds["volumes"] if v["name"] == "token"]
    assert token_vol["secret"]["secretName"] == ingest["name"]
    policy = _one(objs, "NetworkPolicy", "kmend")
    assert policy["spec"]["ingress"][0]["ports"][0]["port"] == dep["containers"][0]["ports"][0]["containerPort"]


def test_values_schema_is_what_the_settings_classes_make() -> None:
    gen = runpy.run_path(str(REPO / "deploy" / "tools" / "gen_values_schema.py"))
    assert (CHART / "values.schema.json").read_text() == gen["render"](), (
        "stale: run python deploy/tools/gen_values_schema.py")
    schema = gen["build"]()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # values.yaml lists every setting the schema allows, each with kmend's default or null.
    for section in ("controlPlane", "agent"):
        assert set(values[section]["config"]) == set(schema["properties"][section]["properties"]["config"]
                                                     ["properties"]), section


@pytest.mark.parametrize(("values", "path", "says"), [
    ({"controlPlane": {"config": {"hang_kk": 3}}}, "/controlPlane/config", "'hang_kk' not allowed"),
    ({"controlPlane": {"config": {"hang_k": "abc"}}}, "/controlPlane/config/hang_k", "want number"),
    ({"agent": {"config": {"kernel": "dmesg"}}}, "/agent/config/kernel", "'kmsg', 'file', 'off'"),
    ({"agent": {"config": {"batch_size": 0}}}, "/agent/config/batch_size", "minimum"),
    ({"controlPlane": {"replicas": 0}}, "/controlPlane/replicas", "minimum"),
])
def test_misspelt_or_mistyped_settings_fail_naming_them(values: dict[str, Any], path: str, says: str) -> None:
    """Helm checks values.schema.json before rendering: `helm install` fails the same way."""
    with pytest.raises(helm.HelmValuesError) as err:
        _objects(values)
    assert f"at '{path}'" in str(err.value) and says in str(err.value)


@pytest.mark.parametrize(("section", "cls"), [("controlPlane", Settings), ("agent", AgentSettings)])
def test_values_show_kmends_own_defaults(section: str, cls: type[Any]) -> None:
    """A value the chart lists is kmend's default (null: left to kmend), so a default changed in the code
    cannot be pinned back silently by the chart."""
    config = yaml.safe_load((CHART / "values.yaml").read_text())[section]["config"]
    differ = {}
    for name, value in config.items():
        if value is None:
            continue
        field = cls.model_fields[name]
        default = field.default_factory() if field.default_factory is not None else field.default
        if isinstance(default, Path):
            default = str(default)
        if value != default:
            differ[name] = (value, default)
    assert differ == {}, f"values.yaml differs from kmend's defaults (value, default): {differ}"
