"""Healing steps through the Kubernetes adapters and the real client on the loopback fake API server: drain
against a PodDisruptionBudget, checkpoint publication and gang restart through each kind of owner (PyTorchJob,
JobSet, Volcano Job, plain pods), node validation; and the control plane's ClusterRole granting exactly the
verbs these runs (plus the gang scheduler and leader election) make."""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from healer.kube.cluster import KubeCluster
from healer.kube.workloads import KubeWorkloads
from healer.notify import LogNotifier
from healer.records import ActionStep, Mode, Plan, StepKind, StepState
from healer.steps.base import StepContext, StepOutcome
from healer.steps.checkpoint import checkpoint
from healer.steps.drain import drain
from healer.steps.repair import validate
from healer.steps.restart import restart_job
from kmend.wiring import default_health_check_template
from tests.fake_apiserver import FakeApiServer
from tests.healing import Clock, fast_policy

NS = "training"
MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "service" / "kmend.yaml"
TRAINING_OPERATOR = ("PyTorchJob", "TFJob", "MPIJob", "XGBoostJob", "PaddleJob", "JAXJob")
"""Kubeflow training-operator v1 kinds: kmend reads their checkpoint path and annotates their resume point."""
KINDS = {**{k: ("kubeflow.org", "v1", k.lower() + "s") for k in TRAINING_OPERATOR},
         "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
         "VolcanoJob": ("batch.volcano.sh", "v1alpha1", "jobs"), "Command": ("bus.volcano.sh", "v1alpha1", "commands")}


class _NoHistory:
    def restarts_of(self, job: str, *, exclude_plan: str) -> list[float]:
        return []


@dataclass
class World:
    """The fake API server, a StepContext on the Kube adapters, and a plan to run steps of."""

    api: FakeApiServer
    ctx: StepContext
    clock: Clock

    def run(self, kind: StepKind, step_fn: Any, node: str | None = None, **params: str) -> Iterator[StepOutcome]:
        """Run a step round after round, carrying its outputs like the executor does."""
        step = ActionStep("plan-1-0", kind, node, params)
        plan = Plan("plan-1", "inc-1", "test", Mode.AUTO, (step,))
        while True:
            out = step_fn(step, plan, self.ctx)
            step = ActionStep(step.id, kind, node, params, out.state, out.result, {**step.outputs, **out.outputs})
            yield out
            self.clock.advance(1)

    def gang(self, job: str, nodes: list[str], owner: dict[str, Any] | None, labels: dict[str, str]) -> None:
        for i, node in enumerate(nodes):
            self.api.add_pod(NS, f"{job}-{i}", node=node, phase="Running", labels={"kmend.io/job": job, **labels},
                             owners=[owner] if owner else None)

    def owner(self, kind: str, name: str, **extra: Any) -> dict[str, Any]:
        group, version, plural = KINDS.get(kind, ("batch", "v1", "jobs"))
        obj = self.api.add_object(group, version, plural, NS, {"metadata": {"name": name, **extra}})
        return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": name,
                "uid": obj["metadata"]["uid"], "controller": True}

    def live(self, job: str) -> list[dict[str, Any]]:
        return [p for (ns, _), p in sorted(self.api.pods.items()) if p["metadata"]["labels"].get("kmend.io/job") == job]

    def kubelet_finishes(self) -> None:
        for (ns, name), p in list(self.api.pods.items()):
            if p["metadata"].get("deletionTimestamp"):
                self.api.finish_termination(ns, name)
        self.api.run_disruption_controller()  # no controller-manager here: its budget status is simulated


@pytest.fixture
def world() -> Iterator[World]:
    with FakeApiServer() as api:
        for i in range(4):
            api.add_node(f"gpu-{i}")
        for kind, (group, version, plural) in KINDS.items():
            api.install_kind(group, version, plural, "Job" if plural == "jobs" else kind)
        api.install_crd("scheduling.x-k8s.io", "v1alpha1")
        api.install_crd("scheduling.volcano.sh", "v1beta1")
        api.add_service_account(NS)  # the serviceaccount controller's work: pods are admitted only after it
        apis = client.ApiClient(client.Configuration(host=api.url))
        clock = Clock()
        ctx = StepContext(KubeCluster(apis), KubeWorkloads(apis), LogNotifier(), fast_policy(), None,  # type: ignore[arg-type]
                          _NoHistory(), clock, "kmend-system", default_health_check_template().read_text())
        yield World(api, ctx, clock)


def _hf_checkpoint(root: Path, step: int) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with zipfile.ZipFile(d / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", b"weights")


def test_drain_waits_on_a_disruption_budget_and_never_deletes_what_it_guards(world: World) -> None:
    _drain_scenario(world)


def _drain_scenario(world: World) -> None:
    world.gang("llama", ["gpu-1", "gpu-1", "gpu-2"], None, {"app": "llama"})
    world.api.add_object("policy", "v1", "poddisruptionbudgets", NS, {
        "metadata": {"name": "llama"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "llama"}}}})
    world.api.run_disruption_controller()
    rounds = world.run(StepKind.DRAIN, drain, "gpu-1", job="llama", namespace=NS, grace_s="120")
    first = next(rounds)
    assert first.state is StepState.WAITING and "eviction refused" in first.result and "429" in first.result
    on_node = [p for p in world.live("llama") if p["spec"]["nodeName"] == "gpu-1"]
    assert [p["metadata"].get("deletionGracePeriodSeconds") for p in on_node] == [120, None]
    world.kubelet_finishes()
    world.api.add_pod(NS, "llama-0b", node="gpu-3", phase="Running", labels={"kmend.io/job": "llama", "app": "llama"})
    world.api.run_disruption_controller()
    assert next(rounds).state is StepState.WAITING  # the second pod may go now: the budget has a new pod
    world.kubelet_finishes()
    assert next(rounds).state is StepState.SUCCEEDED
    assert {p["spec"]["nodeName"] for p in world.live("llama")} == {"gpu-2", "gpu-3"}


@pytest.mark.parametrize("kind", [*TRAINING_OPERATOR, "JobSet", "VolcanoJob", "Job"])
def test_checkpoint_is_published_and_the_gang_restarts_through_its_owner(world: World, kind: str,
                                                                          tmp_path: Path) -> None:
    _owner_scenario(world, kind, tmp_path)


def _owner_scenario(world: World, kind: str, tmp_path: Path) -> None:
    _hf_checkpoint(tmp_path, 400)
    annotations = {"annotations": {"kmend.io/checkpoint-path": str(tmp_path)}}
    labels: dict[str, str] = {}
    if kind == "JobSet":
        world.owner("JobSet", "llama", **annotations)
        labels = {"jobset.sigs.k8s.io/jobset-name": "llama"}
        owner = world.owner("Job", "llama-workers-0", labels=labels)
    else:
        owner = world.owner(kind, "llama", **annotations)
    world.gang("llama", ["gpu-0", "gpu-1"], owner, labels)
    [published] = list(_until_done(world.run(StepKind.CHECKPOINT, checkpoint, job="llama", namespace=NS)))
    assert published.state is StepState.SUCCEEDED and published.outputs["resume_step"] == "400"
    cm = world.api.object("", "v1", "configmaps", NS, "llama-kmend-resume")
    assert cm is not None and cm["data"]["KMEND_RESUME_FROM"] == str(tmp_path / "checkpoint-400")
    group, version, plural = KINDS.get("JobSet" if kind == "JobSet" else kind, ("batch", "v1", "jobs"))
    stored = world.api.object(group, version, plural, NS, "llama")
    assert stored is not None and stored["metadata"]["annotations"]["kmend.io/resume-from"].endswith("checkpoint-400")

    rounds = world.run(StepKind.RESTART_JOB, restart_job, "gpu-1", job="llama", namespace=NS, grace_s="30")
    assert next(rounds).state is StepState.WAITING  # the run being restarted is journaled first
    next(rounds)
    if kind == "VolcanoJob":
        [cmd] = world.api.workload.objects[KINDS["Command"]].values()
        assert cmd["action"] == "RestartJob" and cmd["target"]["uid"] == owner["uid"]
        for p in world.live("llama"):  # the Volcano controller restarts the job's pods
            world.api.handle("DELETE", f"/api/v1/namespaces/{NS}/pods/{p['metadata']['name']}", None, "")
    assert all(p["metadata"].get("deletionTimestamp") for p in world.live("llama"))
    world.kubelet_finishes()
    world.gang("llama", ["gpu-2", "gpu-3"], owner, labels)  # the owner's controller brings the ranks back
    outcome = next(rounds)
    assert outcome.state is StepState.SUCCEEDED, outcome.result
    assert outcome.outputs["restarted_nodes"] == "gpu-2,gpu-3"


def test_plain_pods_are_recreated_from_their_recorded_spec(world: World, tmp_path: Path) -> None:
    _plain_pods_scenario(world, tmp_path)


def _plain_pods_scenario(world: World, tmp_path: Path) -> None:
    world.gang("solo", ["gpu-0", "gpu-1"], None, {"kmend.io/pod-group": "solo"})
    _hf_checkpoint(tmp_path, 90)
    list(_until_done(world.run(StepKind.CHECKPOINT, checkpoint, job="solo", namespace=NS,
                               default_path=str(tmp_path))))
    assert all(p["metadata"]["annotations"]["kmend.io/resume-from"].endswith("checkpoint-90")
               for p in world.live("solo"))
    rounds = world.run(StepKind.RESTART_JOB, restart_job, "gpu-1", job="solo", namespace=NS, grace_s="30")
    next(rounds)
    assert "terminating" in next(rounds).result
    world.kubelet_finishes()
    assert next(rounds).state is StepState.WAITING  # recreated, not yet bound
    pods = world.live("solo")
    assert [p["metadata"]["name"] for p in pods] == ["solo-0", "solo-1"]
    assert all(not p["spec"].get("nodeName") and p["status"]["phase"] == "Pending" for p in pods)
    assert all(p["metadata"]["annotations"]["kmend.io/resume-from"].endswith("checkpoint-90") for p in pods)
    for p, node in zip(pods, ["gpu-2", "gpu-3"], strict=True):
        p["spec"]["nodeName"] = node
    assert next(rounds).state is StepState.SUCCEEDED


def test_validation_runs_the_health_check_job_on_the_node(world: World) -> None:
    _validation_scenario(world)


def _validation_scenario(world: World) -> None:
    rounds = world.run(StepKind.VALIDATE, validate, "gpu-1", image="dcgm:4")
    assert next(rounds).state is StepState.WAITING
    [(key, job)] = [(k, j) for k, j in world.api.workload.objects[("batch", "v1", "jobs")].items()
                    if k[0] == "kmend-system"]
    assert job["spec"]["template"]["spec"]["nodeName"] == "gpu-1"
    world.api.set_status("batch", "v1", "jobs", *key, {"succeeded": 1})
    assert next(rounds).state is StepState.SUCCEEDED


def _until_done(rounds: Iterator[StepOutcome]) -> Iterator[StepOutcome]:
    for out in rounds:
        if out.state is not StepState.WAITING:
            yield out
            return


def _granted() -> set[tuple[str, str, str]]:
    # The ClusterRole bound to the control plane's ServiceAccount: the only role it needs (its Lease included).
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role") and d["metadata"]["name"] == "kmend"]
    assert [r["kind"] for r in roles] == ["ClusterRole"]
    return {(g, r, v) for role in roles for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def test_cluster_role_grants_exactly_the_verbs_the_adapters_use(world: World, tmp_path: Path) -> None:
    from healer.cluster import ClusterEvent, Condition, Taint
    from healer.gang.port import ObjectRef, PodGroupPhase, PodGroupStatus
    from healer.gang.records import PodGroupKind
    from healer.kube.lease import KubeLeases
    from healer.kube.pods import KubePodScheduling, pod_record
    from healer.lease import LeaderElector
    from healer.workloads import ObjectKey

    apis = world.ctx.workloads.api  # type: ignore[attr-defined]
    # Quarantine and release (the Cluster port).
    cluster = world.ctx.cluster
    cluster.cordon("gpu-1")
    cluster.add_taint("gpu-1", Taint("kmend.io/fault", "gpu_lost", "NoSchedule"))
    cluster.set_condition("gpu-1", Condition("KmendHealthy", "False", "GpuLost", "Xid 79"))
    cluster.patch_node_metadata("gpu-1", labels={"kmend.io/quarantined": "true"})
    cluster.emit_event(ClusterEvent("gpu-1", "KmendQuarantine", "inc-1"))
    cluster.list_nodes()
    # The opt-out check reads the job's namespace; the healing steps do the rest.
    world.api.add_pod(NS, "probe", node="gpu-0", phase="Running")
    world.ctx.workloads.get_object(ObjectKey("v1", "Namespace", "", NS))
    _drain_scenario(world)
    for kind in (*TRAINING_OPERATOR, "JobSet", "VolcanoJob", "Job"):
        for (ns, name) in [k for k in world.api.pods if k[1].startswith("llama")]:
            world.api.pods.pop((ns, name))
        for resource, store in world.api.workload.objects.items():
            if resource[2] != "configmaps":  # kept: the second publication updates the resume ConfigMap
                store.clear()
        _owner_scenario(world, kind, tmp_path / kind)
    _plain_pods_scenario(world, tmp_path / "plain")
    _validation_scenario(world)
    # The gang scheduler: snapshot, bind, release, PodGroup status and events.
    sched = KubePodScheduling(apis, clock=world.clock)
    pod = pod_record(world.api.add_pod(NS, "gang-0", scheduler="kmend"))
    sched.snapshot()
    sched.list_pending("kmend")
    sched.changes("")  # the informer and caches: one list each, then watches from background threads
    watches = {("WATCH", "/api/v1/pods"), ("WATCH", "/apis/scheduling.x-k8s.io/v1alpha1/podgroups"),
               ("WATCH", "/apis/scheduling.volcano.sh/v1beta1/podgroups")}
    deadline = time.monotonic() + 30
    while not watches <= set(world.api.requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    sched.bind(pod, "gpu-2")
    sched.delete_pod(pod)
    for kind, (group, version) in {PodGroupKind.COSCHEDULING: ("scheduling.x-k8s.io", "v1alpha1"),
                                   PodGroupKind.VOLCANO: ("scheduling.volcano.sh", "v1beta1")}.items():
        world.api.add_custom(group, version, NS, "g", {"minMember": 1})
        sched.set_pod_group_status(NS, "g", kind, PodGroupStatus(PodGroupPhase.SCHEDULED, 1))
    sched.emit_event(ObjectRef("Pod", NS, "gang-0", pod.uid), "Scheduled", "bound")
    sched.close()
    # Leader election.
    elector = LeaderElector(KubeLeases(apis), namespace="kmend-system", name="kmend", identity="a", clock=world.clock)
    assert elector.tick()
    world.clock.advance(elector.renew_s)  # renewed once its renewal period has passed
    assert elector.tick()

    used = world.api.verbs()
    granted = _granted()
    assert used - granted == set(), "the ClusterRole lacks verbs the adapters use"
    assert granted - used == set(), "the ClusterRole grants verbs no adapter uses"
