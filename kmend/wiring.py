"""Build the service from settings: store, cluster adapter, notifier, rules."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from analyzer.detectors.hang import HangConfig
from analyzer.detectors.straggler import StragglerConfig
from analyzer.progress_rules import load_progress_rules
from analyzer.rules import load_rules
from healer.cluster import Cluster
from healer.notify import LogNotifier, Notifier, WebhookNotifier
from healer.policy import PolicyConfig
from kmend.metrics import Metrics
from kmend.service import HealerConfig, Kmend
from kmend.settings import Settings
from kmend.store import Store
from sim.cluster import build_cluster

log = logging.getLogger("kmend")


def make_cluster(settings: Settings) -> Cluster:
    """The real cluster when configured (or auto-detected), else the simulated one."""
    choice = settings.cluster
    if choice == "auto":
        in_cluster = settings.in_cluster or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        has_kubeconfig = bool(settings.kubeconfig) or Path(os.environ.get("KUBECONFIG", "")).is_file()
        choice = "kube" if (in_cluster or has_kubeconfig) else "sim"
        settings = settings.model_copy(update={"in_cluster": in_cluster})
    if choice == "kube":
        from healer.kube import KubeCluster  # only here: the sim default needs no client

        log.info("acting on a real cluster")
        return KubeCluster.from_config(settings.kubeconfig, in_cluster=settings.in_cluster,
                                       event_namespace=settings.event_namespace)
    log.info("acting on a simulated cluster of %d nodes", settings.sim_nodes)
    return build_cluster(settings.sim_nodes, settings.sim_gpus_per_node)


def make_notifier(settings: Settings) -> Notifier:
    """Webhook when configured, else the log."""
    return WebhookNotifier(settings.notify_webhook_url) if settings.notify_webhook_url else LogNotifier()


def make_kmend(settings: Settings, *, cluster: Cluster | None = None, notifier: Notifier | None = None,
               metrics: Metrics | None = None) -> Kmend:
    """The service core for these settings (rules are validated here: a bad rule stops start-up)."""
    rules = load_rules(settings.rules_dirs)
    return Kmend(
        Store(settings.database_url),
        cluster if cluster is not None else make_cluster(settings),
        rules,
        notifier or make_notifier(settings),
        metrics=metrics or Metrics(),
        healer=HealerConfig(PolicyConfig(dry_run=settings.dry_run, require_approval=settings.require_approval),
                            symptom_settle_s=settings.symptom_settle_s, interval_s=settings.healer_interval_s,
                            detector_interval_s=settings.detector_interval_s),
        correlation_window_s=settings.correlation_window_s,
        progress_rules=load_progress_rules(settings.progress_rules_dirs),
        hang=HangConfig(k=settings.hang_k, floor_s=settings.hang_floor_s),
        straggler=StragglerConfig(min_slowdown=settings.straggler_min_slowdown,
                                  persistence=settings.straggler_persistence),
        flight_recorder_settle_s=settings.flight_recorder_settle_s,
    )
