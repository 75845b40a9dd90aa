"""Build the service from settings: store, cluster ports, lease, notifier, rules, policy."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from analyzer.detectors.hang import HangConfig
from analyzer.detectors.straggler import StragglerConfig
from analyzer.metric_rules import load_signal_rules
from analyzer.progress_rules import load_progress_rules
from analyzer.rules import load_rules
from healer.cluster import Cluster
from healer.gang.config import SchedulerConfig
from healer.gang.metrics import SchedulerMetrics
from healer.gang.port import PodScheduling
from healer.gang.scheduler import GangScheduler
from healer.identity import TokenReviewer
from healer.lease import AlwaysLeader, LeaderElector, LeaseRecord
from healer.notify import AlertmanagerNotifier, FanOut, LogNotifier, Notifier, WebhookNotifier
from healer.policy import PolicyConfig
from healer.policy_file import load_policy
from healer.workloads import Workloads
from kmend.early import Early, Ports, cluster_choice, kube_gang_scheduler, kube_ports, make_leader
from kmend.healer_config import HealerConfig
from kmend.healing import Leader
from kmend.metrics import Metrics
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.store import Store
from kmend.store.retention import Retention
from sim.cluster import SimCluster
from sim.workloads import SimWorkloads
from sim.world import JobSpec, SimWorld

log = logging.getLogger("kmend")


def default_health_check_template() -> Path:
    """deploy/healthcheck/job-template.yaml of this source tree."""
    return Path(__file__).resolve().parent.parent / "deploy" / "healthcheck" / "job-template.yaml"


def make_ports(settings: Settings) -> Ports:
    """The real cluster when configured (or auto-detected), else the simulated one."""
    choice, settings = cluster_choice(settings)
    if choice == "kube":
        return kube_ports(settings)
    log.info("acting on a simulated cluster of %d nodes", settings.sim_nodes)
    job = JobSpec("llama-70b-pretrain", settings.sim_job_nodes, checkpoint_path=settings.sim_checkpoint_path) \
        if settings.sim_job_nodes else None
    world = SimWorld(nodes=settings.sim_nodes, gpus=settings.sim_gpus_per_node, spares=settings.sim_spares, job=job,
                     path=settings.sim_state_file, crash_after=settings.sim_crash_after,
                     crash_before=settings.sim_crash_before)
    return Ports(world.cluster, world.workloads, None, world)


def make_notifier(settings: Settings) -> Notifier:
    """Webhook and/or Alertmanager when configured, else the log."""
    sinks: list[Notifier] = []
    if settings.notify_webhook_url:
        sinks.append(WebhookNotifier(settings.notify_webhook_url))
    if settings.alertmanager_url:
        sinks.append(AlertmanagerNotifier(settings.alertmanager_url))
    if not sinks:
        return LogNotifier()
    return sinks[0] if len(sinks) == 1 else FanOut(sinks)


def make_scheduler(settings: Settings, cluster: Cluster, leader: Leader, metrics: Metrics,
                   port: PodScheduling | None) -> GangScheduler | None:
    """The gang scheduler, acting only while this replica holds the Lease.

    On by default on a real cluster; the simulated default has no pods of its own to place
    unless a port is handed in.
    """
    enabled = settings.scheduler if settings.scheduler is not None else (port is not None or
                                                                         not isinstance(cluster, SimCluster))
    if not enabled:
        return None
    if port is None:
        return kube_gang_scheduler(settings, cluster, leader.is_leader, metrics)
    return GangScheduler(port=port, is_leader=leader.is_leader, clock=time.time,
                         config=SchedulerConfig(scheduler_name=settings.scheduler_name),
                         metrics=SchedulerMetrics(metrics.registry))


def make_kmend(settings: Settings, *, cluster: Cluster | None = None, workloads: Workloads | None = None,
               notifier: Notifier | None = None, metrics: Metrics | None = None,
               leader: Leader | None = None, pod_scheduling: PodScheduling | None = None,
               early: Early | None = None) -> Kmend:
    """The service core for these settings (rules and the policy are validated here: a bad one stops start-up).

    ``early``: the real cluster's ports and the running scheduler that ``start_early`` made.
    """
    rules = load_rules(settings.rules_dirs)
    policy = load_policy(settings.policy_file)
    if early is not None:
        cluster, workloads, leases = early.ports.cluster, early.ports.workloads, early.ports.leases
        leader, metrics = early.leader, early.metrics
    elif cluster is None:
        ports = make_ports(settings)
        cluster, workloads, leases = ports.cluster, ports.workloads, ports.leases
    else:
        leases = None
        if workloads is None:
            if not isinstance(cluster, SimCluster):
                raise ValueError("a Workloads adapter is needed with a non-simulated cluster")
            workloads = SimWorkloads(cluster)
    assert workloads is not None
    template_path = settings.health_check_template or default_health_check_template()
    template = template_path.read_text() if template_path.is_file() else ""
    if not template:
        log.warning("no health-check template at %s: validation steps will fail", template_path)
    store = Store(settings.database_url, lines=settings.store_lines)
    leader = leader or make_leader(settings, leases)
    metrics = metrics or Metrics()
    scheduler = early.scheduler if early is not None else make_scheduler(settings, cluster, leader, metrics,
                                                                         pod_scheduling)
    watch = getattr(scheduler.port, "pods_on_node", None) if scheduler is not None else None
    if callable(watch) and hasattr(workloads, "pod_watch"):
        # The healer's "which pods run on this node now" reads the scheduler's pod watch (KubeWorkloads).
        setattr(workloads, "pod_watch", watch)  # noqa: B010 - an attribute of the Kubernetes adapter only
    kmend = Kmend(
        store, cluster, rules, notifier or make_notifier(settings),
        workloads=workloads, policy=policy, leader=leader, metrics=metrics,
        scheduler=scheduler,
        healer=HealerConfig(PolicyConfig(dry_run=settings.dry_run, require_approval=settings.require_approval),
                            symptom_settle_s=settings.symptom_settle_s, interval_s=settings.healer_interval_s,
                            detector_interval_s=settings.detector_interval_s,
                            quiet_resolve_s=settings.incident_quiet_resolve_s,
                            retention=Retention(signals_s=settings.retention_signals_s,
                                                incidents_s=settings.retention_incidents_s,
                                                plans_s=settings.retention_plans_s, audit_s=settings.retention_audit_s,
                                                requests_s=settings.retention_requests_s)),
        correlation_window_s=settings.correlation_window_s, health_check_template=template,
        namespace=settings.namespace,
        progress_rules=load_progress_rules(settings.progress_rules_dirs),
        hang=HangConfig(k=settings.hang_k, floor_s=settings.hang_floor_s, hold_k=settings.hang_hold_k,
                        first_steps_timeout_s=settings.hang_first_steps_timeout_s),
        straggler=StragglerConfig(min_slowdown=settings.straggler_min_slowdown,
                                  persistence=settings.straggler_persistence),
        flight_recorder_settle_s=settings.flight_recorder_settle_s,
        # The simulated job's own checkpoint path is configured by the operator too: it is allowed.
        checkpoint_roots=[str(p) for p in settings.checkpoint_roots]
        + ([settings.sim_checkpoint_path] if settings.sim_checkpoint_path else []),
        signal_rules=load_signal_rules(settings.metric_rules_dirs),
    )
    if settings.replicated:
        from kmend.replicas import Replicas
        from kmend.store.feed import Feed

        if isinstance(kmend.healing.leader, AlwaysLeader):
            log.warning("replicated without a Kubernetes Lease: every replica would heal; run one replica")
        kmend.replicas = Replicas(kmend, Feed(store), identity=settings.identity or socket.gethostname())
    elector = kmend.healing.leader
    if isinstance(elector, LeaderElector):
        scheduler = kmend.scheduler

        # start_early's first tick may come before the schema exists: recorded once it does (Kmend.start).
        recording = [early is None]

        def lease_changed(lease: LeaseRecord | None) -> None:
            if recording[0]:
                store.ledger.lease_seen(lease, settings.lease_name)
            if lease is not None and scheduler is not None:
                scheduler.wake()  # leading now: gangs that wait are placed at once, not at the next tick

        def record_lease() -> None:
            recording[0] = True
            if elector.observed is not None:
                store.ledger.lease_seen(elector.observed, settings.lease_name)

        elector.on_change = lease_changed
        kmend.on_start.append(record_lease)
    return kmend


def make_token_reviewer(settings: Settings) -> TokenReviewer | None:
    """The TokenReview client when ``token_review`` is on (the Kubernetes adapter), else None."""
    if not settings.token_review:
        return None
    from healer.kube.tokenreview import KubeTokenReviewer  # only here: the default needs no client

    in_cluster = settings.in_cluster or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    return KubeTokenReviewer.from_config(settings.kubeconfig, in_cluster=in_cluster,
                                         audiences=settings.token_review_audiences)


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def listen_host(settings: Settings) -> str:
    """Where ``kmend serve`` listens: the configured host, or loopback only while the API is open."""
    from kmend.api.deps import auth_open  # the web stack, only for `kmend serve`

    if not auth_open(settings):
        return settings.host
    log.warning(
        "NO API TOKENS CONFIGURED: anyone who reaches the port can read incidents, quarantine nodes and reset "
        "the breaker. Listening on 127.0.0.1 only%s. Set KMEND_INGEST_TOKEN, KMEND_READER_TOKEN and "
        "KMEND_OPERATOR_TOKEN (or KMEND_TOKEN_REVIEW=true) to serve other hosts.",
        "" if settings.host in LOOPBACK else f" (not {settings.host})")
    return settings.host if settings.host in LOOPBACK else "127.0.0.1"
