"""Strict field validation of custom-resource writes: the loopback fake refuses a PodGroup field its CRD does not
declare when ``fieldValidation=Strict`` is asked (and prunes it otherwise, as a real server does), and kmend's
PodGroup status, reason and training-job annotations all go out Strict and fit the CRDs' schemas."""

from __future__ import annotations

import time

import httpx
from kubernetes import client

from healer.gang.port import PodGroupPhase, PodGroupStatus
from healer.gang.records import PodGroupKind
from healer.kube.pods import REASON_ANNOTATION, SCHEDULED_ANNOTATION, KubePodScheduling
from healer.kube.workloads import KubeWorkloads
from healer.workloads import ObjectKey
from tests.fake_apiserver import FakeApiServer

COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1")
MERGE = {"content-type": "application/merge-patch+json"}


def test_the_fake_refuses_an_undeclared_pod_group_field_only_when_strict_is_asked() -> None:
    with FakeApiServer() as api:
        api.install_crd(*COSCHEDULING)
        api.add_custom(*COSCHEDULING, "t", "g", {"minMember": 2})
        url = f"{api.url}/apis/scheduling.x-k8s.io/v1alpha1/namespaces/t/podgroups/g/status"
        body = {"status": {"phase": "Scheduled", "scheduled": 2}}
        refused = httpx.patch(url, params={"fieldValidation": "Strict"}, json=body, headers=MERGE)
        assert refused.status_code == 422
        assert ".status.scheduled: field not declared in schema" in refused.json()["message"]
        stored = api.custom[COSCHEDULING][("t", "g")]
        assert "phase" not in stored.get("status", {})
        # Without Strict the write "succeeds": the field is pruned, and only a warning says so.
        assert httpx.patch(url, json=body, headers=MERGE).status_code == 200
        assert stored["status"] == {"phase": "Scheduled"}
        assert any('unknown field "status.scheduled"' in w for w in api.warnings), api.warnings
        assert api.lax_writes == ["PATCH /apis/scheduling.x-k8s.io/v1alpha1/namespaces/t/podgroups/g/status"]


def test_kmends_custom_resource_writes_are_strict_and_fit_the_crds() -> None:
    with FakeApiServer() as api:
        api.install_crd(*COSCHEDULING)
        api.install_crd("scheduling.volcano.sh", "v1beta1")
        api.add_custom(*COSCHEDULING, "t", "g", {"minMember": 2})
        api.add_custom("scheduling.volcano.sh", "v1beta1", "t", "v", {"minMember": 2})
        api.install_kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
        api.add_object("kubeflow.org", "v1", "pytorchjobs", "t", {"metadata": {"name": "llama"}})
        api_client = client.ApiClient(client.Configuration(host=api.url))
        kube = KubePodScheduling(api_client, clock=time.time)
        kube.set_pod_group_status("t", "g", PodGroupKind.COSCHEDULING,
                                  PodGroupStatus(PodGroupPhase.PENDING, 1, "needs 2 pods"))
        kube.set_pod_group_status("t", "v", PodGroupKind.VOLCANO, PodGroupStatus(PodGroupPhase.SCHEDULED, 2))
        KubeWorkloads(api_client).annotate(ObjectKey("kubeflow.org/v1", "PyTorchJob", "t", "llama"),
                                           {"kmend.io/resume-from": "/ckpt/step-100"})
        assert api.lax_writes == [] and api.warnings == [], (api.lax_writes, api.warnings)
        group = api.custom[COSCHEDULING][("t", "g")]
        assert group["status"] == {"phase": "Pending"}
        assert group["metadata"]["annotations"] == {REASON_ANNOTATION: "needs 2 pods", SCHEDULED_ANNOTATION: "1"}
        assert api.custom[("scheduling.volcano.sh", "v1beta1")][("t", "v")]["status"] == {"phase": "Running",
                                                                                         "running": 2}
