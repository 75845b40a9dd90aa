"""KubeCluster through the real client against a loopback API server: error mapping, retries, conflicts."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from healer.cluster import ClusterEvent, PermanentError, Taint, TemporaryError
from healer.executor import PlanExecutor
from healer.kube.cluster import KubeCluster
from healer.kube.workloads import KubeWorkloads
from healer.notify import LogNotifier
from healer.policy_file import load_policy
from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState
from healer.steps.base import RepairRequest, StepContext
from tests.fake_apiserver import FakeApiServer


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node("gpu-1")
        yield server


def _kube(api: FakeApiServer) -> KubeCluster:
    return KubeCluster(client.ApiClient(client.Configuration(host=api.url)), request_timeout_s=5)


class NoRequests:
    def open(self, request: RepairRequest) -> RepairRequest:
        return request

    def get(self, request_id: str) -> RepairRequest | None:
        return None

    def answer(self, request_id: str, state: str, result: str) -> RepairRequest | None:
        return None

    def restarts_of(self, job: str, *, exclude_plan: str) -> list[float]:
        return []


class NullJournal:
    def save_plan(self, plan: Plan) -> None:
        return None

    def save_step(self, plan_id: str, step: ActionStep) -> None:
        return None


def test_errors_map_to_retry_classes(api: FakeApiServer) -> None:
    kube = _kube(api)
    for status, kind in ((429, TemporaryError), (500, TemporaryError), (503, TemporaryError),
                         (403, PermanentError), (422, PermanentError)):
        api.fail("PATCH", r"/nodes/gpu-1$", status, f"injected {status}")
        with pytest.raises(kind) as err:
            kube.cordon("gpu-1")
        assert str(status) in str(err.value) and f"injected {status}" in str(err.value)


def test_a_stale_taint_write_is_reread_and_retried(api: FakeApiServer) -> None:
    kube = _kube(api)
    api.fail("PATCH", r"/nodes/gpu-1$", 409, "the object has been modified")
    kube.add_taint("gpu-1", Taint("kmend.io/fault", "gpu_lost", "NoSchedule"))
    assert api.nodes["gpu-1"]["spec"]["taints"] == [{"key": "kmend.io/fault", "value": "gpu_lost",
                                                     "effect": "NoSchedule"}]
    assert [m for m, p in api.requests if p == "/api/v1/nodes/gpu-1"].count("GET") == 2


def test_taints_written_back_keep_their_api_fields(api: FakeApiServer) -> None:
    api.nodes["gpu-1"]["spec"]["taints"] = [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute",
                                             "timeAdded": "2026-11-21T10:00:00Z"}]
    _kube(api).add_taint("gpu-1", Taint("kmend.io/fault", "nvlink", "NoSchedule"))
    kept, added = api.nodes["gpu-1"]["spec"]["taints"]
    assert (kept["key"], kept["effect"]) == ("node.kubernetes.io/unreachable", "NoExecute")
    assert dt.datetime.fromisoformat(kept["timeAdded"]) == dt.datetime(2026, 11, 21, 10, tzinfo=dt.UTC)
    assert added == {"key": "kmend.io/fault", "value": "nvlink", "effect": "NoSchedule"}


def test_plan_survives_throttling_and_server_errors_without_duplicate_actions(api: FakeApiServer) -> None:
    api.fail("PATCH", r"/nodes/gpu-1$", 429, "Too Many Requests")
    api.fail("PATCH", r"/nodes/gpu-1$", 500, "etcdserver: request timed out")
    api.fail("POST", r"/events$", 503, "unavailable")
    steps = (ActionStep("p-0", StepKind.CORDON, "gpu-1"),
             ActionStep("p-1", StepKind.TAINT, "gpu-1", {"key": "kmend.io/fault", "value": "gpu_lost",
                                                         "effect": "NoSchedule"}),
             ActionStep("p-2", StepKind.EVENT, "gpu-1", {"reason": "KmendQuarantine", "message": "inc-1"}))
    kube = _kube(api)
    ctx = StepContext(kube, KubeWorkloads(kube.api), LogNotifier(), load_policy(), NoRequests(), NoRequests(),
                      time.time)
    done = PlanExecutor(ctx, NullJournal(), sleep=lambda _s: None).execute(
        Plan("p", "inc-1", "quarantine-hardware", Mode.AUTO, steps))
    assert done.state is PlanState.SUCCEEDED and all(s.state is StepState.SUCCEEDED for s in done.steps)
    node = api.nodes["gpu-1"]
    assert node["spec"]["unschedulable"] is True
    assert [t["key"] for t in node["spec"]["taints"]] == ["kmend.io/fault"]
    assert len(api.events) == 1 and api.events[0]["involvedObject"]["kind"] == "Node"
    assert api.events[0]["reason"] == "KmendQuarantine"


def test_event_names_the_node_and_reporting_component(api: FakeApiServer) -> None:
    _kube(api).emit_event(ClusterEvent("gpu-1", "KmendQuarantine", "incident inc-9: gpu_lost"))
    [ev] = api.events
    assert ev["involvedObject"]["name"] == "gpu-1"
    assert ev["involvedObject"]["uid"] == api.nodes["gpu-1"]["metadata"]["uid"]
    assert ev["source"]["component"] == "kmend" and ev["reportingComponent"] == "kmend"
    assert ev["metadata"]["namespace"] == "default"


def test_node_events_go_to_default_whatever_namespace_kmend_runs_in(api: FakeApiServer) -> None:
    # As the Deployment runs it: KMEND_EVENT_NAMESPACE=kmend-system. A real v1.36 server answers 422 to an
    # Event about a Node in any namespace but `default`; the fake refuses it the same way.
    kube = KubeCluster(client.ApiClient(client.Configuration(host=api.url)), request_timeout_s=5,
                       event_namespace="kmend-system")
    kube.emit_event(ClusterEvent("gpu-1", "KmendQuarantine", "incident inc-9: gpu_lost", key="plan-9-4"))
    [ev] = api.events
    assert ev["metadata"]["namespace"] == "default" and not ev["involvedObject"].get("namespace")
    raw = client.ApiClient(client.Configuration(host=api.url))
    with pytest.raises(client.ApiException) as refused:
        client.CoreV1Api(raw).create_namespaced_event("kmend-system", client.CoreV1Event(
            metadata=client.V1ObjectMeta(name="x"),
            involved_object=client.V1ObjectReference(kind="Node", name="gpu-1")))
    assert refused.value.status == 422 and "does not match event.namespace" in str(refused.value.body)


def test_a_keyed_event_sent_again_after_a_crash_is_not_duplicated(api: FakeApiServer) -> None:
    kube = _kube(api)
    kube.emit_event(ClusterEvent("gpu-1", "KmendQuarantine", "incident inc-1", key="plan-1-4"))
    kube.emit_event(ClusterEvent("gpu-1", "KmendQuarantine", "incident inc-1", key="plan-1-4"))  # 409 AlreadyExists
    assert len(api.events) == 1
    api.fail("POST", r"/events$", 504, "timeout")  # the write may or may not have landed: retried, still once
    with pytest.raises(TemporaryError):
        kube.emit_event(ClusterEvent("gpu-1", "KmendRepairRequested", "replace", key="plan-1-9"))
    kube.emit_event(ClusterEvent("gpu-1", "KmendRepairRequested", "replace", key="plan-1-9"))
    kube.emit_event(ClusterEvent("gpu-1", "KmendRepairRequested", "replace", key="plan-1-9"))
    assert [e["reason"] for e in api.events] == ["KmendQuarantine", "KmendRepairRequested"]


def test_node_event_lands_in_default_whatever_the_event_namespace_setting(api: FakeApiServer) -> None:
    # The shipped Deployment sets KMEND_EVENT_NAMESPACE=kmend-system; a real API server refuses an Event
    # about a Node anywhere but `default` (422), which used to fail every quarantine plan at its event step.
    kube = KubeCluster(client.ApiClient(client.Configuration(host=api.url)), event_namespace="kmend-system",
                       request_timeout_s=5)
    kube.emit_event(ClusterEvent("gpu-1", "KmendQuarantine", "incident inc-9: gpu_lost", key="plan-9-1"))
    [ev] = api.events
    assert ev["metadata"]["namespace"] == "default" and not ev["involvedObject"].get("namespace")


def test_quarantine_plan_succeeds_with_the_deployments_event_namespace(api: FakeApiServer) -> None:
    # The Deployment's KMEND_EVENT_NAMESPACE=kmend-system used to end every quarantine plan failed at its Event.
    steps = (ActionStep("q-0", StepKind.CORDON, "gpu-1"),
             ActionStep("q-1", StepKind.EVENT, "gpu-1", {"reason": "KmendQuarantine", "message": "inc-2: Xid 79"}))
    kube = KubeCluster(client.ApiClient(client.Configuration(host=api.url)), event_namespace="kmend-system",
                       request_timeout_s=5)
    ctx = StepContext(kube, KubeWorkloads(kube.api), LogNotifier(), load_policy(), NoRequests(), NoRequests(),
                      time.time)
    done = PlanExecutor(ctx, NullJournal(), sleep=lambda _s: None).execute(
        Plan("q", "inc-2", "quarantine-hardware", Mode.AUTO, steps))
    assert done.state is PlanState.SUCCEEDED, [s.result for s in done.steps]
    assert [e["metadata"]["namespace"] for e in api.events] == ["default"]
