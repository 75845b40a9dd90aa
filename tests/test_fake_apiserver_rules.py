"""The loopback API server refuses what a real one refuses, one test per rule of KUBERNETES-API.md.

Each test drives the fake through the official client, as kmend does, so a rule kmend depends on
cannot silently pass here and fail on a real cluster.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.fake_apiserver import FakeApiServer, RoleRules


@pytest.fixture
def core() -> Iterator[tuple[FakeApiServer, client.CoreV1Api]]:
    with FakeApiServer() as server:
        server.add_node("gpu-1")
        yield server, client.CoreV1Api(client.ApiClient(client.Configuration(host=server.url)))


def _node_event(namespace: str, involved_namespace: str | None = None) -> client.CoreV1Event:
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="gpu-1.", namespace=namespace),
        involved_object=client.V1ObjectReference(kind="Node", name="gpu-1", api_version="v1",
                                                 namespace=involved_namespace),
        reason="Test", message="m", type="Normal")


def test_event_about_a_node_outside_default_is_422_naming_the_field(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("kmend-system", _node_event("kmend-system"))
    assert err.value.status == 422
    message = json.loads(err.value.body)["message"]
    assert 'involvedObject.namespace: Invalid value: "": does not match event.namespace' in message
    assert server.events == []


def test_event_about_a_node_in_default_is_accepted(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    api.create_namespaced_event("default", _node_event("default"))
    [ev] = server.events
    assert ev["metadata"]["namespace"] == "default" and not ev["involvedObject"].get("namespace")


def test_event_about_a_namespaced_object_lives_in_its_namespace(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    _, api = core
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("default", _node_event("default", involved_namespace="team-a"))
    assert err.value.status == 422
    assert '"team-a": does not match event.namespace' in json.loads(err.value.body)["message"]
    api.create_namespaced_event("team-a", _node_event("team-a", involved_namespace="team-a"))


def test_status_is_written_only_through_the_status_subresource(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    cond = {"type": "KmendHealthy", "status": "False", "reason": "Xid79"}
    api.patch_node("gpu-1", {"status": {"conditions": [cond]}})
    assert "KmendHealthy" not in {c["type"] for c in server.nodes["gpu-1"]["status"]["conditions"]}
    api.patch_node_status("gpu-1", {"status": {"conditions": [cond]}})
    assert "KmendHealthy" in {c["type"] for c in server.nodes["gpu-1"]["status"]["conditions"]}


def test_new_node_carries_not_ready_taint_until_ready(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    _, api = core
    api.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="gpu-2")))
    assert [(t.key, t.effect) for t in api.read_node("gpu-2").spec.taints] == [
        ("node.kubernetes.io/not-ready", "NoSchedule")]
    api.patch_node_status("gpu-2", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert not api.read_node("gpu-2").spec.taints


def _bind(api: client.CoreV1Api, pod: str, node: str) -> None:
    body = client.V1Binding(metadata=client.V1ObjectMeta(name=pod),
                            target=client.V1ObjectReference(kind="Node", name=node, api_version="v1"))
    api.create_namespaced_pod_binding(pod, "team-a", body, _preload_content=False)


def test_binding_an_already_bound_pod_is_409(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    server.add_node("gpu-2")
    server.add_pod("team-a", "w-0", scheduler="kmend")
    _bind(api, "w-0", "gpu-1")
    with pytest.raises(ApiException) as err:
        _bind(api, "w-0", "gpu-2")
    assert err.value.status == 409
    assert api.read_namespaced_pod("w-0", "team-a").spec.node_name == "gpu-1"


def test_eviction_under_a_budget_the_disruption_controller_has_not_processed_is_429(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    for name in ("w-0", "w-1"):
        server.add_pod("team-a", name, node="gpu-1", phase="Running", labels={"job": "j"})
    server.add_object("policy", "v1", "poddisruptionbudgets", "team-a", {
        "metadata": {"name": "j"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"job": "j"}}}})
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="w-0", namespace="team-a"))
    with pytest.raises(ApiException) as err:  # one disruption would be fine, but no status says so yet
        api.create_namespaced_pod_eviction("w-0", "team-a", eviction)
    assert err.value.status == 429
    server.run_disruption_controller()
    api.create_namespaced_pod_eviction("w-0", "team-a", eviction)
    assert api.read_namespaced_pod("w-0", "team-a").metadata.deletion_timestamp is not None


def test_eviction_under_a_budget_allowing_no_disruption_is_429(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    server.add_pod("team-a", "w-0", node="gpu-1", phase="Running", labels={"job": "j"})
    server.add_object("policy", "v1", "poddisruptionbudgets", "team-a", {
        "metadata": {"name": "j"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"job": "j"}}}})
    server.run_disruption_controller()
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="w-0", namespace="team-a"))
    with pytest.raises(ApiException) as err:
        api.create_namespaced_pod_eviction("w-0", "team-a", eviction)
    assert err.value.status == 429
    assert not api.read_namespaced_pod("w-0", "team-a").metadata.deletion_timestamp


def test_deleted_bound_pod_stays_terminating_until_a_grace_0_delete(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    server.add_pod("team-a", "w-0", node="gpu-1", phase="Running")
    api.delete_namespaced_pod("w-0", "team-a")
    assert api.read_namespaced_pod("w-0", "team-a").metadata.deletion_timestamp is not None
    api.delete_namespaced_pod("w-0", "team-a", grace_period_seconds=0)
    with pytest.raises(ApiException) as err:
        api.read_namespaced_pod("w-0", "team-a")
    assert err.value.status == 404


def test_pod_in_a_namespace_without_its_service_account_is_403(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="w-0"),
                       spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="busybox")]))
    with pytest.raises(ApiException) as err:
        api.create_namespaced_pod("team-a", pod)
    assert err.value.status == 403
    assert 'error looking up service account team-a/default: serviceaccount "default" not found' in json.loads(
        err.value.body)["message"]
    server.add_service_account("team-a")
    api.create_namespaced_pod("team-a", pod)
    assert ("team-a", "w-0") in server.pods


def _raw(server: FakeApiServer, method: str, path: str, body: object, ctype: str = "application/json",
         strict: bool = True) -> tuple[int, dict[str, Any], str | None]:
    """A request as JSON, bypassing the typed client (which would refuse unknown fields before sending)."""
    query = "?fieldValidation=Strict" if strict else ""
    request = urllib.request.Request(f"{server.url}{path}{query}", method=method, data=json.dumps(body).encode(),
                                     headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Warning")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers.get("Warning")


_NODE_EVENT = {"metadata": {"generateName": "gpu-1.", "namespace": "default"}, "reason": "Test",
               "involvedObject": {"kind": "Node", "name": "gpu-1", "nodeName": "gpu-1"}}


def test_unknown_field_in_a_strict_create_is_400_with_its_path(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, out, _ = _raw(server, "POST", "/api/v1/namespaces/default/events", _NODE_EVENT)
    assert code == 400 and out["message"] == ('Event in version "v1" cannot be handled as a Event: '
                                              'strict decoding error: unknown field "involvedObject.nodeName"')
    assert server.events == []


def test_unknown_field_without_strict_is_dropped_with_a_warning(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, _, warning = _raw(server, "POST", "/api/v1/namespaces/default/events", _NODE_EVENT, strict=False)
    assert code == 201 and warning == r'299 - "unknown field \"involvedObject.nodeName\""'
    [ev] = server.events
    assert "nodeName" not in ev["involvedObject"]


def test_unknown_field_in_a_strict_node_patch_is_422_with_its_path(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, out, _ = _raw(server, "PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [
        {"key": "kmend.io/fault", "effect": "NoSchedule", "reason": "xid"}]}}, "application/strategic-merge-patch+json")
    assert code == 422 and 'strict decoding error: unknown field "spec.taints[0].reason"' in out["message"]
    assert server.nodes["gpu-1"]["spec"]["taints"] == []


def test_unknown_field_in_a_strict_node_status_patch_is_422(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, out, _ = _raw(server, "PATCH", "/api/v1/nodes/gpu-1/status", {"status": {"conditions": [
        {"type": "KmendHealthy", "status": "False", "since": "now"}]}}, "application/strategic-merge-patch+json")
    assert code == 422 and 'unknown field "status.conditions[0].since"' in out["message"]
    assert "KmendHealthy" not in {c["type"] for c in server.nodes["gpu-1"]["status"]["conditions"]}


def test_a_patch_may_remove_keys_and_leave_out_required_fields(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, _, _ = _raw(server, "PATCH", "/api/v1/nodes/gpu-1/status", {"status": {"conditions": [
        {"type": "KmendHealthy", "message": "no status given"}]}}, "application/strategic-merge-patch+json")
    assert code == 200
    code, _, _ = _raw(server, "PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"labels": {"gone": None}},
                                                              "spec": {"unschedulable": True}},
                      "application/strategic-merge-patch+json")
    assert code == 200 and server.nodes["gpu-1"]["spec"]["unschedulable"] is True


def test_wrong_type_in_a_patch_is_422_naming_the_field_in_any_mode(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, out, _ = _raw(server, "PATCH", "/api/v1/nodes/gpu-1", {"spec": {"unschedulable": "yes"}},
                        "application/strategic-merge-patch+json", strict=False)
    assert code == 422 and "spec.unschedulable" in out["message"]
    assert not server.nodes["gpu-1"]["spec"].get("unschedulable")


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("POST", "/api/v1/namespaces/team-a/pods/w-0/binding",
     {"metadata": {"name": "w-0"}, "target": {"kind": "Node", "name": "gpu-1", "node": "gpu-1"}}, "target.node"),
    ("POST", "/api/v1/namespaces/team-a/pods/w-0/eviction",
     {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "w-0"}, "deleteOptions": {"grace": 5}},
     "deleteOptions.grace"),
    ("POST", "/apis/coordination.k8s.io/v1/namespaces/kmend-system/leases",
     {"metadata": {"name": "kmend"}, "spec": {"holder": "a"}}, "spec.holder"),
    ("POST", "/api/v1/namespaces/team-a/configmaps",
     {"metadata": {"name": "llama-kmend-resume"}, "values": {"a": "b"}}, "values"),
    ("PATCH", "/api/v1/namespaces/team-a/configmaps/llama-kmend-resume", {"datas": {"a": "b"}}, "datas"),
    ("POST", "/apis/batch/v1/namespaces/kmend-system/jobs",
     {"metadata": {"name": "kmend-validate-1"}, "spec": {"template": {"spec": {"node": "gpu-1"}}}},
     "spec.template.spec.node"),
])
def test_unknown_field_in_other_objects_kmend_writes_is_refused_when_strict(
        core: tuple[FakeApiServer, client.CoreV1Api], method: str, path: str, body: dict[str, object],
        field: str) -> None:
    server, _ = core
    server.add_pod("team-a", "w-0", node="gpu-1", phase="Running")
    code, out, _ = _raw(server, method, path, body, "application/merge-patch+json" if method == "PATCH"
                        else "application/json")
    assert (code, f'strict decoding error: unknown field "{field}"' in out["message"]) == (
        422 if method == "PATCH" else 400, True)
    assert not server.pods[("team-a", "w-0")]["metadata"].get("deletionTimestamp")


@pytest.mark.parametrize(("method", "path", "body", "code", "message"), [
    ("PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"labels": {"kmend.io/spare-for": "training/llama"}}}, 422,
     'Node "gpu-1" is invalid: metadata.labels: Invalid value: "training/llama": a valid label must be'),
    ("PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"annotations": {"kmend.io/repair request": "x"}}}, 422,
     'Node "gpu-1" is invalid: metadata.annotations: Invalid value: "kmend.io/repair request": name part must'),
    ("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [{"key": "kmend.io/fault", "value": "gpu lost",
                                                            "effect": "NoSchedule"}]}}, 422,
     'Node "gpu-1" is invalid: metadata.taints[0].value: Invalid value: "gpu lost": a valid label must be'),
    ("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [{"key": "kmend.io/fault", "effect": "Quarantine"}]}}, 422,
     'metadata.taints[0].effect: Unsupported value: "Quarantine": supported values: "NoSchedule", '
     '"PreferNoSchedule", "NoExecute"'),
    ("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"},
                                                           {"key": "a", "value": "x", "effect": "NoSchedule"}]}},
     422, "taints must be unique by key and effect pair"),
    ("POST", "/api/v1/namespaces/team-a/pods/w-0/binding",
     {"metadata": {"name": "other"}, "target": {"kind": "Node", "name": "gpu-1"}}, 400,
     "name in URL does not match name in Binding object"),
    ("POST", "/api/v1/namespaces/team-a/pods/w-0/eviction",
     {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "other"}}, 400,
     "name in URL does not match name in Eviction object"),
    ("POST", "/apis/coordination.k8s.io/v1/namespaces/kmend-system/leases",
     {"metadata": {"name": "kmend"}, "spec": {"leaseDurationSeconds": 0}}, 422,
     'Lease.coordination.k8s.io "kmend" is invalid: spec.leaseDurationSeconds: Invalid value: 0: must be greater '
     "than 0"),
    ("POST", "/api/v1/namespaces/team-a/configmaps", {"metadata": {"name": "Llama-kmend-resume-"}}, 422,
     'ConfigMap "Llama-kmend-resume-" is invalid: metadata.name: Invalid value: "Llama-kmend-resume-": a lowercase '
     "RFC 1123 subdomain"),
    ("POST", "/api/v1/namespaces/team-a/configmaps", {"metadata": {"name": "cm"}, "data": {"resume from": "x"}}, 422,
     'ConfigMap "cm" is invalid: data[resume from]: Invalid value: "resume from": a valid config key'),
    ("POST", "/apis/batch/v1/namespaces/kmend-system/jobs", {"metadata": {"name": "kmend-validate-1"}, "spec": {
        "template": {"spec": {"restartPolicy": "Always", "containers": [{"name": "c", "image": "busybox"}]}}}}, 422,
     'Job.batch "kmend-validate-1" is invalid: spec.template.spec.restartPolicy: Required value: valid values: '
     '"OnFailure", "Never"'),
    ("POST", "/apis/batch/v1/namespaces/kmend-system/jobs", {"metadata": {"name": "k" * 64}, "spec": {
        "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}}}, 422,
     f'spec.template.labels: Invalid value: "{"k" * 64}": must be no more than 63 bytes'),
    # v1.36 words a length error on its own, before (and beside) a character error.
    ("PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"labels": {"kmend.io/spare-for": "j" * 64}}}, 422,
     f'Node "gpu-1" is invalid: metadata.labels: Invalid value: "{"j" * 64}": must be no more than 63 bytes'),
    ("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [{"key": "kmend.io/fault", "value": "v" * 64,
                                                            "effect": "NoSchedule"}]}}, 422,
     f'metadata.taints[0].value: Invalid value: "{"v" * 64}": must be no more than 63 bytes'),
    ("PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"labels": {f"kmend.io/{'n' * 64}": "x"}}}, 422,
     f'metadata.labels: Invalid value: "kmend.io/{"n" * 64}": name part must be no more than 63 bytes'),
])
def test_the_servers_own_validation_of_what_kmend_writes(
        core: tuple[FakeApiServer, client.CoreV1Api], method: str, path: str, body: dict[str, object], code: int,
        message: str) -> None:
    server, _ = core
    server.add_pod("team-a", "w-0", node="gpu-1", phase="Running")
    before = json.dumps(server.nodes["gpu-1"], sort_keys=True)
    got, out, _ = _raw(server, method, path, body, "application/strategic-merge-patch+json" if method == "PATCH"
                       else "application/json")
    assert got == code and message in out["message"], out
    assert json.dumps(server.nodes["gpu-1"], sort_keys=True) == before
    assert not server.pods[("team-a", "w-0")]["metadata"].get("deletionTimestamp")


def test_event_names_are_not_checked_as_subdomains(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, _ = core
    code, _, _ = _raw(server, "POST", "/api/v1/namespaces/default/events", {
        "metadata": {"name": "GPU_1.x"}, "reason": "T", "involvedObject": {"kind": "Node", "name": "gpu-1"}})
    assert code == 201 and [e["metadata"]["name"] for e in server.events] == ["GPU_1.x"]


def test_binding_a_pod_with_scheduling_gates_is_409(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    server.add_pod("team-a", "w-0", scheduler="kmend", gates=["kueue.x-k8s.io/admission"])
    with pytest.raises(ApiException) as err:
        _bind(api, "w-0", "gpu-1")
    assert err.value.status == 409
    assert json.loads(err.value.body)["message"] == ('Operation cannot be fulfilled on pods/binding "w-0": '
                                                     "pod w-0 has non-empty .spec.schedulingGates")
    assert not api.read_namespaced_pod("w-0", "team-a").spec.node_name


def test_a_lease_update_without_its_resource_version_or_naming_another_lease_is_refused(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    """As kube-apiserver v1.24 and v1.36 answer (checked by hand; the wording is v1.36's): an update is never
    unconditional (422 naming metadata.resourceVersion, not a 409 a client would read as a lost election), and a
    body naming another lease is a bad request before the lease is looked up; neither changes the lease."""
    server, _ = core
    where = "/apis/coordination.k8s.io/v1/namespaces/kmend-system/leases"
    code, lease, _ = _raw(server, "POST", where, {"metadata": {"name": "kmend"}, "spec": {"holderIdentity": "a"}},
                          "application/json")
    assert code == 201
    code, out, _ = _raw(server, "PUT", f"{where}/kmend", {"metadata": {"name": "kmend"},
                                                          "spec": {"holderIdentity": "b"}}, "application/json")
    assert code == 422 and "metadata.resourceVersion: Invalid value: 0: must be specified for an update" in \
        out["message"], out
    renamed = {"metadata": {**lease["metadata"], "name": "other"}, "spec": {"holderIdentity": "b"}}
    for target in ("kmend", "missing"):
        code, out, _ = _raw(server, "PUT", f"{where}/{target}", renamed, "application/json")
        assert code == 400 and f"the name of the object (other) does not match the name on the URL ({target})" in \
            out["message"], out
    assert server.leases[("kmend-system", "kmend")]["spec"] == {"holderIdentity": "a"}
    code, _, _ = _raw(server, "PUT", f"{where}/kmend", {"metadata": lease["metadata"],
                                                        "spec": {"holderIdentity": "b"}}, "application/json")
    assert code == 200 and server.leases[("kmend-system", "kmend")]["spec"] == {"holderIdentity": "b"}


def test_a_strategic_merge_patch_of_a_custom_resource_is_415(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    """Custom resources have no strategic-merge schema: v1.36 refuses the patch type (PodGroups, PyTorchJobs
    alike) and changes nothing; a merge patch of the same body goes through."""
    server, _ = core
    server.install_crd("scheduling.x-k8s.io", "v1alpha1")
    server.add_custom("scheduling.x-k8s.io", "v1alpha1", "team-a", "llama", {"minMember": 4})
    server.install_kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
    server.add_object("kubeflow.org", "v1", "pytorchjobs", "team-a", {"metadata": {"name": "llama"}})
    body = {"metadata": {"annotations": {"kmend.io/resume-from": "step-100"}}}
    for path in ("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/team-a/podgroups/llama",
                 "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs/llama"):
        code, out, _ = _raw(server, "PATCH", path, body, "application/strategic-merge-patch+json", strict=False)
        assert code == 415 and out["message"] == (
            "the body of the request was in an unknown format - accepted media types include: "
            "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"), out
        code, out, _ = _raw(server, "PATCH", path, body, "application/merge-patch+json", strict=False)
        assert code == 200 and out["metadata"]["annotations"]["kmend.io/resume-from"] == "step-100", out


def test_deleting_a_pod_with_another_uid_is_409_as_the_server_words_it(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    uid = server.add_pod("team-a", "w-0", node="gpu-1", phase="Running")["metadata"]["uid"]
    server.add_pod("team-a", "w-1")
    for name, record in (("w-0", uid), ("w-1", server.pods[("team-a", "w-1")]["metadata"]["uid"])):
        with pytest.raises(ApiException) as err:
            api.delete_namespaced_pod(name, "team-a", body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid="other")))
        assert err.value.status == 409
        assert json.loads(err.value.body)["message"] == (
            f'Operation cannot be fulfilled on Pod "{name}": the UID in the precondition (other) does not match the '
            f"UID in record ({record}). The object might have been deleted and then recreated")
    assert set(server.pods) >= {("team-a", "w-0"), ("team-a", "w-1")}


def test_a_role_rule_with_resource_names_grants_only_those_objects() -> None:
    """kube-apiserver's RBAC: ``resourceNames`` limit a rule to requests naming those objects, so it never grants a
    list, a watch or a create; the 403 names the group and the object as v1.36 does."""
    user = "system:serviceaccount:kmend-system:kmend"
    rbac = RoleRules([{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "resourceNames": ["kmend-healer"], "verbs": ["get", "update"]}], token="t", user=user)
    with FakeApiServer(rbac=rbac) as server:
        api = client.CoordinationV1Api(client.ApiClient(client.Configuration(
            host=server.url, api_key={"authorization": "Bearer t"})))
        with pytest.raises(ApiException) as err:  # allowed by RBAC: the lease does not exist yet
            api.read_namespaced_lease("kmend-healer", "kmend-system")
        assert err.value.status == 404
        for call, args, verb, what, scope in (
                (api.read_namespaced_lease, ("kube-scheduler", "kube-system"), "get",
                 'leases.coordination.k8s.io "kube-scheduler"', 'in the namespace "kube-system"'),
                (api.list_namespaced_lease, ("kmend-system",), "list", "leases.coordination.k8s.io",
                 'in the namespace "kmend-system"'),
                (api.create_namespaced_lease, ("kmend-system", {"metadata": {"name": "kmend-healer"}}), "create",
                 "leases.coordination.k8s.io", 'in the namespace "kmend-system"')):
            with pytest.raises(ApiException) as err:
                call(*args)
            assert err.value.status == 403
            assert json.loads(err.value.body)["message"] == (
                f'{what} is forbidden: User "{user}" cannot {verb} resource "leases" in API group '
                f'"coordination.k8s.io" {scope}')


def test_status_in_a_write_of_a_custom_resource_or_job_itself_is_dropped(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    """Custom resources with a status subresource and Jobs: v1.36 answers 200 to a merge patch of the object that
    names ``status``, keeps the other fields and leaves the status as the controller wrote it."""
    server, _ = core
    server.install_kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
    server.add_object("kubeflow.org", "v1", "pytorchjobs", "team-a", {"metadata": {"name": "llama"}})
    server.set_status("kubeflow.org", "v1", "pytorchjobs", "team-a", "llama", {"replicaStatuses": {}})
    server.add_object("batch", "v1", "jobs", "team-a", {"metadata": {"name": "check"}, "spec": {"template": {
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}}})
    for path, plural, name in (("/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs/llama", "pytorchjobs", "llama"),
                               ("/apis/batch/v1/namespaces/team-a/jobs/check", "jobs", "check")):
        group = "kubeflow.org" if plural == "pytorchjobs" else "batch"
        version = "v1"
        before = (server.object(group, version, plural, "team-a", name) or {}).get("status")
        code, out, _ = _raw(server, "PATCH", path, {"metadata": {"annotations": {"kmend.io/x": "y"}},
                                                    "status": {"succeeded": 1}}, "application/merge-patch+json",
                            strict=False)
        assert code == 200, out
        stored = server.object(group, version, plural, "team-a", name) or {}
        assert stored["metadata"]["annotations"]["kmend.io/x"] == "y" and stored.get("status") == before, stored


def test_a_starting_server_refuses_before_its_roles_load_and_throttles_with_retry_after() -> None:
    """Seen on kube-apiserver v1.36.2 in its first ~0.1 s: 403 with the authorizer's `RBAC: clusterrole... not
    found` (the bootstrap roles are not loaded yet) and 429 `Too many requests` with `Retry-After: 1`; then the
    request the role grants is served."""
    user = "system:serviceaccount:kmend-system:kmend"
    rbac = RoleRules([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}], token="t", user=user)
    with FakeApiServer(rbac=rbac, startup_s=0.0, startup_requests=2) as server:
        server.add_node("gpu-1")
        cfg = client.Configuration(host=server.url)
        cfg.api_key = {"authorization": "Bearer t"}
        cfg.retries = False  # see each answer as the server gives it (the client would sleep through a 429 itself)
        api = client.CoreV1Api(client.ApiClient(cfg))
        with pytest.raises(ApiException) as err:
            api.list_node()
        assert err.value.status == 403
        assert json.loads(err.value.body)["message"] == (
            f'nodes is forbidden: User "{user}" cannot list resource "nodes" in API group "" at the cluster scope: '
            'RBAC: clusterrole.rbac.authorization.k8s.io "kmend" not found')
        with pytest.raises(ApiException) as err:
            api.list_node()
        assert err.value.status == 429 and (err.value.headers or {}).get("Retry-After") == "1"
        assert json.loads(err.value.body)["reason"] == "TooManyRequests"
        assert [n.metadata.name for n in api.list_node().items] == ["gpu-1"]


def test_a_stopped_server_refuses_connections_and_comes_back_on_its_port_with_its_objects() -> None:
    with FakeApiServer() as server:
        server.add_node("gpu-1")
        cfg = client.Configuration(host=server.url)
        cfg.retries = False
        api = client.CoreV1Api(client.ApiClient(cfg))
        api.read_node("gpu-1")  # a pooled keep-alive connection, reset by the stop
        server.down()
        with pytest.raises(urllib3.exceptions.HTTPError) as refused:
            api.read_node("gpu-1")
        assert "Connection refused" in str(refused.value) or "reset" in str(refused.value).lower(), refused.value
        server.up()
        assert api.read_node("gpu-1").metadata.name == "gpu-1"
