"""KubePodScheduling: object conversion, effective requests, quantities, error mapping, and pods held back by
scheduling gates (left alone by the gang scheduler on the loopback API server until their last gate goes)."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from healer.cluster import NotFoundError, PermanentError, TemporaryError
from healer.gang.port import ConflictError
from healer.gang.quantity import canonical
from healer.gang.records import PodGroupKind, SelectorOperator, TolerationOperator
from healer.kube.pods import effective_requests, map_error, node_record, pod_group_record, pod_record


@pytest.mark.parametrize(("resource", "text", "value"), [
    ("cpu", "500m", 500), ("cpu", "2", 2000), ("cpu", "0.1", 100), ("memory", "16Gi", 16 * 2**30),
    ("memory", "1e3", 1000), ("memory", "1k", 1000), ("nvidia.com/gpu", "8", 8), ("memory", "1.5Ki", 1536),
])
def test_quantities(resource: str, text: str, value: int) -> None:
    assert canonical(resource, text) == value


def test_effective_requests_count_init_containers_and_overhead() -> None:
    spec = {
        "containers": [{"resources": {"requests": {"cpu": "1", "nvidia.com/gpu": "8"}}},
                       {"resources": {"requests": {"cpu": "500m"}}}],
        "initContainers": [{"resources": {"requests": {"cpu": "4"}}},
                           {"restartPolicy": "Always", "resources": {"requests": {"cpu": "250m"}}}],
        "overhead": {"cpu": "100m"},
    }
    assert effective_requests(spec) == {"cpu": 4100, "nvidia.com/gpu": 8, "pods": 1}


def test_pod_record_reads_scheduling_fields() -> None:
    pod = pod_record({
        "metadata": {"name": "w-0", "namespace": "t", "uid": "u", "creationTimestamp": "2024-01-01T00:00:00Z",
                     "deletionTimestamp": "2024-01-01T00:01:00Z",
                     "labels": {"scheduling.x-k8s.io/pod-group": "g"}},
        "spec": {"schedulerName": "kmend", "nodeName": "n1", "priority": 100,
                 "tolerations": [{"key": "kmend.io/fault", "operator": "Exists", "effect": "NoSchedule"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [
                         {"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
                 "containers": [{"resources": {"requests": {"nvidia.com/gpu": "8"}}}]},
        "status": {"phase": "Running"}})
    assert (pod.node_name, pod.terminating, pod.finished, pod.priority) == ("n1", True, False, 100)
    assert pod.tolerations[0].operator == TolerationOperator.EXISTS
    assert pod.affinity[0].match_expressions[0].operator == SelectorOperator.IN
    assert pod.created == 1704067200.0


def test_node_and_pod_group_records() -> None:
    node = node_record({"metadata": {"name": "n1", "labels": {"a": "b"}},
                        "spec": {"unschedulable": True, "taints": [{"key": "k", "effect": "NoSchedule"}]},
                        "status": {"allocatable": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8"}}})
    assert node.unschedulable and node.taints[0].value == "" and node.allocatable["cpu"] == 96000
    pg = pod_group_record({"metadata": {"name": "g", "namespace": "t"},
                           "spec": {"minMember": 64, "minResources": {"nvidia.com/gpu": "512"},
                                    "scheduleTimeoutSeconds": 120}}, PodGroupKind.COSCHEDULING)
    assert pg.min_member == 64 and pg.min_resources["nvidia.com/gpu"] == 512
    assert pg.schedule_timeout_seconds == 120.0


@pytest.mark.parametrize(("status", "cls"), [
    (404, NotFoundError), (409, ConflictError), (429, TemporaryError), (503, TemporaryError),
    (403, PermanentError), (422, PermanentError)])
def test_error_mapping(status: int, cls: type[Exception]) -> None:
    exc = ApiException(status=status, reason="x")
    exc.body = '{"message": "the API says no"}'
    mapped = map_error(exc)
    assert type(mapped) is cls
    assert str(mapped) == "the API says no"


def test_pod_group_status_and_events_reach_the_api_with_api_field_names() -> None:
    from kubernetes import client

    from healer.gang.port import ObjectRef, PodGroupPhase, PodGroupStatus
    from healer.kube.pods import REASON_ANNOTATION, KubePodScheduling
    from tests.fake_apiserver import FakeApiServer

    with FakeApiServer() as api:
        api.install_crd("scheduling.x-k8s.io", "v1alpha1")
        api.add_custom("scheduling.x-k8s.io", "v1alpha1", "t", "g", {"minMember": 2, "scheduleTimeoutSeconds": 90})
        kube = KubePodScheduling(client.ApiClient(client.Configuration(host=api.url)), clock=lambda: 1e9)
        (group,) = kube.snapshot().pod_groups  # the Volcano CRD is absent: no groups, no error
        assert (group.min_member, group.schedule_timeout_seconds) == (2, 90.0)
        kube.set_pod_group_status("t", "g", PodGroupKind.COSCHEDULING,
                                  PodGroupStatus(PodGroupPhase.PENDING, 0, "needs 2 pods"))
        stored = api.custom[("scheduling.x-k8s.io", "v1alpha1")][("t", "g")]
        assert stored["status"] == {"phase": "Pending"}
        assert stored["metadata"]["annotations"][REASON_ANNOTATION] == "needs 2 pods"
        kube.set_pod_group_status("t", "g", PodGroupKind.COSCHEDULING, PodGroupStatus(PodGroupPhase.SCHEDULED, 2))
        assert stored["status"]["phase"] == "Scheduled" and REASON_ANNOTATION not in stored["metadata"]["annotations"]
        kube.set_pod_group_status("t", "missing", PodGroupKind.COSCHEDULING, PodGroupStatus(PodGroupPhase.SCHEDULED, 1))
        kube.emit_event(ObjectRef("PodGroup", "t", "g", group.uid, "scheduling.x-k8s.io/v1alpha1"),
                        "FailedScheduling", "needs 2 pods", "Warning")
        (event,) = api.events
        assert event["involvedObject"] == {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
                                           "name": "g", "namespace": "t", "uid": group.uid}
        assert (event["reportingComponent"], event["source"]["component"]) == ("kmend", "kmend")


def test_a_gated_pod_is_left_alone_until_its_gates_are_removed() -> None:
    """A pod a queue holds back (``spec.schedulingGates``) cannot be bound on a real server (409): the gang
    scheduler leaves it pending, and places it once the queue removes its last gate."""
    import time

    from kubernetes import client

    from healer.gang.scheduler import GangScheduler
    from healer.kube.pods import KubePodScheduling
    from tests.fake_apiserver import FakeApiServer

    with FakeApiServer() as api:
        api.add_node("gpu-1")
        api.nodes["gpu-1"]["status"]["allocatable"] = {"cpu": "8", "memory": "8Gi", "pods": "10"}
        api.add_pod("team-a", "w-0", scheduler="kmend", requests={"cpu": "1"}, gates=["kueue.x-k8s.io/admission"])
        kube = KubePodScheduling(client.ApiClient(client.Configuration(host=api.url)), clock=time.time)
        sched = GangScheduler(port=kube, is_leader=lambda: True, clock=time.time)
        try:
            assert [p.name for p in kube.list_pending("kmend")] == []
            sched.run_once()
            assert not api.pods[("team-a", "w-0")]["spec"].get("nodeName")
            assert not any(p.endswith("/binding") for _, p in api.requests)
            with api._lock:  # the queue admits it: the gate goes
                pod = api.pods[("team-a", "w-0")]
                del pod["spec"]["schedulingGates"]
                api.pod_changed("MODIFIED", pod)
            deadline = time.monotonic() + 30
            while not api.pods[("team-a", "w-0")]["spec"].get("nodeName") and time.monotonic() < deadline:
                sched.run_once()
                time.sleep(0.05)
            assert api.pods[("team-a", "w-0")]["spec"]["nodeName"] == "gpu-1"
        finally:
            kube.close()
