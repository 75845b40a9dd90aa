"""deploy/agent manifests: the agent DaemonSet, its read-only RBAC, and the Fluent Bit alternative."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kmend.commands.agent import AgentSettings
from tests.conftest import REPO

DEPLOY = REPO / "deploy" / "agent"


def _docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _get(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def _pod(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _get("DaemonSet", name)["spec"]["template"]["spec"]
    return spec


def test_every_manifest_loads_and_is_namespaced_or_cluster_scoped() -> None:
    docs = _docs()
    assert {d["kind"] for d in docs} >= {"DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                         "ConfigMap"}
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "kmend-system"


@pytest.mark.parametrize("name", ["kmend-agent", "kmend-fluent-bit"])
def test_daemonsets_run_everywhere_and_cannot_starve_the_node(name: str) -> None:
    pod = _pod(name)
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    (container,) = pod["containers"]
    res = container["resources"]
    assert res["requests"]["cpu"] and res["limits"]["cpu"] and res["limits"]["memory"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    sc = container["securityContext"]
    if name == "kmend-agent":
        # GPU resets (nvidia-smi needs every /dev/nvidia* and CAP_SYS_ADMIN) and checkpoint searches through
        # /proc/<pid>/root of the training pods (host PID namespace) are the agent's; its root stays read-only.
        assert sc["privileged"] is True and pod["hostPID"] is True and sc["readOnlyRootFilesystem"] is True
        assert "allowPrivilegeEscalation" not in sc  # the API server refuses it false next to privileged
    else:
        assert sc["allowPrivilegeEscalation"] is False


def test_agent_host_paths_are_read_only_except_its_state() -> None:
    pod = _pod("kmend-agent")
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host.values()) >= {"/var/log/pods", "/var/log", "/dev/kmsg", "/sys", "/var/lib/kmend-agent"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for vol, path in host.items():
        assert mounts[vol].get("readOnly", False) is (path != "/var/lib/kmend-agent"), vol
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    # The paths the agent is told match where the volumes are mounted.
    assert env["KMEND_AGENT_IB_ROOT"] == "/host/sys/class/infiniband" and mounts["sys"]["mountPath"] == "/host/sys"
    assert env["KMEND_AGENT_STATE_DIR"] == mounts["state"]["mountPath"]
    assert env["KMEND_AGENT_PROGRESS_DIR"] == mounts["progress"]["mountPath"] == host["progress"]
    fr = mounts["flight-recorder"]["mountPath"]
    assert env["KMEND_AGENT_FLIGHT_RECORDER_DIR"] == fr == host["flight-recorder"]
    probe = pod["containers"][0]["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert pod["containers"][0]["ports"][0]["containerPort"] == AgentSettings(node="n").status_port


def test_agent_env_names_are_settings_the_agent_reads() -> None:
    fields = {f"KMEND_AGENT_{n.upper()}" for n in AgentSettings.model_fields}
    env = [e["name"] for e in _pod("kmend-agent")["containers"][0]["env"]]
    assert [e for e in env if e.startswith("KMEND_AGENT_") and e not in fields] == []


@pytest.mark.parametrize(("role", "resources"), [("kmend-agent", {"pods"}),
                                                 ("kmend-fluent-bit", {"pods", "namespaces"})])
def test_rbac_is_read_only(role: str, resources: set[str]) -> None:
    rules = _get("ClusterRole", role)["rules"]
    assert {r for rule in rules for r in rule["resources"]} == resources
    assert {v for rule in rules for v in rule["verbs"]} == {"get", "list", "watch"}
    binding = _get("ClusterRoleBinding", role)
    assert binding["roleRef"]["name"] == role
    assert binding["subjects"][0]["name"] == _pod(role)["serviceAccountName"]


def test_fluent_bit_configmap_is_the_rendered_config(tmp_path: Path) -> None:
    cm = _get("ConfigMap", "kmend-fluent-bit")
    shipped = yaml.safe_load(cm["data"]["fluent-bit.yaml"])
    out = subprocess.run([sys.executable, "-m", "kmend.cli", "fluentbit-config"], capture_output=True,
                         text=True, check=True, cwd=REPO)
    fresh = yaml.safe_load(out.stdout)

    # The grep patterns are the rule packs' prefilter: a stale one drops the lines of newer rules at the node.
    assert shipped == fresh, (
        "re-render: kmend fluentbit-config --configmap -o deploy/agent/fluent-bit/configmap.yaml")
    assert {f["match"] for f in shipped["pipeline"]["filters"] if f["name"] == "grep"} == {"kube.*", "kmsg"}
    pod = _pod("kmend-fluent-bit")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert pod["containers"][0]["args"] == ["-c", f"{mount['mountPath']}/fluent-bit.yaml"]
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert {"NODE_NAME", "KMEND_TOKEN"} <= env


def test_agent_can_capture_stacks_of_training_processes() -> None:
    # py-spy needs the training pods' processes (host PID namespace) and ptrace on them.
    pod = _pod("kmend-agent")
    assert pod["hostPID"] is True
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc.get("privileged") is True or "SYS_PTRACE" in sc["capabilities"]["add"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert AgentSettings(node="n", stacks=env["KMEND_AGENT_STACKS"]).stacks is True
