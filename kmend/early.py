"""What `kmend serve` starts before the slow part of its start-up: the real cluster's ports and the gang scheduler.

A gang that waits when kmend starts should not wait for what does not gate its placement: the web stack's
imports, the rule packs' compiled matcher, the store's schema check. On a real cluster the scheduler needs only the
client, the Lease and its own informers, so those are built first (imports kept to them), the Lease is taken, and
the scheduler's thread runs while the rest of the service is built; the app's lifespan stops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from healer.cluster import Cluster, ClusterError
from healer.lease import AlwaysLeader, LeaderElector, Leases
from healer.workloads import Workloads
from kmend.settings import Settings

if TYPE_CHECKING:
    from healer.gang.metrics import HeldMetrics
    from healer.gang.scheduler import GangScheduler
    from healer.kube.pods import KubePodScheduling
    from kmend.metrics import Metrics
    from sim.world import SimWorld

log = logging.getLogger("kmend")


@dataclass(frozen=True, slots=True)
class Ports:
    """The cluster the service acts on."""

    cluster: Cluster
    """Nodes."""
    workloads: Workloads
    """Pods, owners, ConfigMaps."""
    leases: Leases | None
    """Leases for leader election (None: a single embedded replica)."""
    world: SimWorld | None = None
    """The simulated world, when simulated."""


def cluster_choice(settings: Settings) -> tuple[str, Settings]:
    """``sim`` or ``kube`` for these settings (``auto``: in a pod or with a kubeconfig, the real cluster)."""
    choice = settings.cluster
    if choice == "auto":
        in_cluster = settings.in_cluster or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        has_kubeconfig = bool(settings.kubeconfig) or Path(os.environ.get("KUBECONFIG", "")).is_file()
        choice = "kube" if (in_cluster or has_kubeconfig) else "sim"
        settings = settings.model_copy(update={"in_cluster": in_cluster})
    return choice, settings


def kube_ports(settings: Settings, *, then: Callable[[Cluster, Leases], None] | None = None) -> Ports:
    """The real cluster's adapters (nodes through their watch-fed cache).

    ``then`` runs once the cluster and its Leases exist, before the Workloads adapter (whose generated API classes
    take the client a third of a second to import): the gang scheduler starts there.
    """
    from healer.kube.cluster import KubeCluster  # only here: the sim default needs no client
    from healer.kube.lease import KubeLeases

    log.info("acting on a real cluster")
    cluster = KubeCluster.from_config(settings.kubeconfig, in_cluster=settings.in_cluster,
                                      event_namespace=settings.event_namespace, node_cache=True)
    leases = KubeLeases(cluster.api)
    if then is not None:
        then(cluster, leases)
    from healer.kube.workloads import KubeWorkloads

    return Ports(cluster, KubeWorkloads(cluster.api), leases)


def make_leader(settings: Settings, leases: Leases | None) -> LeaderElector | AlwaysLeader:
    """A Lease elector when the cluster has Leases, else a lone leader."""
    if leases is None:
        return AlwaysLeader()
    return LeaderElector(leases, namespace=settings.namespace, name=settings.lease_name,
                         identity=settings.identity or socket.gethostname(), duration_s=settings.lease_duration_s,
                         clock=time.time)


class SchedulerLoop:
    """The gang scheduler's thread: ``start`` runs it (once), ``stop`` ends it and closes the port's watches."""

    def __init__(self, scheduler: GangScheduler, period_s: float) -> None:
        self.scheduler = scheduler
        self.period_s = period_s
        self.cycled = threading.Event()
        """Set once the first cycle has ended (its binds answered), failed or not."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the scheduler in a daemon thread; a second call does nothing."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self.scheduler.run, args=(self._stop, self.period_s, self.cycled),
                                            name="kmend-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread, then the Kubernetes port's watch threads (SimPods has none)."""
        self._stop.set()
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        close = getattr(self.scheduler.port, "close", None)
        if callable(close):
            close()


@dataclass(frozen=True, slots=True)
class Early:
    """The pieces started before the service is built, handed to ``make_kmend``."""

    ports: Ports
    """The real cluster's adapters."""
    leader: LeaderElector | AlwaysLeader
    """The Lease elector, already ticked once."""
    metrics: Metrics
    """The service's metrics (the scheduler's are registered in them)."""
    scheduler: GangScheduler | None
    """The gang scheduler (None when turned off)."""
    loop: SchedulerLoop | None
    """Its running thread."""


def kube_pod_scheduling(cluster: Cluster) -> KubePodScheduling:
    """The gang scheduler's port on a real cluster (its pod, node and PodGroup watches start on its first read)."""
    from healer.kube.cluster import KubeCluster
    from healer.kube.pods import KubePodScheduling

    if not isinstance(cluster, KubeCluster):
        raise ValueError("the gang scheduler needs a pod-scheduling port for this cluster")
    return KubePodScheduling(cluster.api, clock=time.time)


def kube_gang_scheduler(settings: Settings, cluster: Cluster, is_leader: Callable[[], bool],
                        metrics: Metrics | HeldMetrics, port: KubePodScheduling | None = None) -> GangScheduler:
    """The gang scheduler on a real cluster's pod and PodGroup watches, acting while `is_leader()`; its cycles are
    counted in ``metrics`` (or held there until the service's registry exists)."""
    from healer.gang.config import SchedulerConfig
    from healer.gang.metrics import HeldMetrics, SchedulerMetrics
    from healer.gang.scheduler import GangScheduler

    kube = port or kube_pod_scheduling(cluster)
    counted = metrics if isinstance(metrics, HeldMetrics) else SchedulerMetrics(metrics.registry)
    scheduler = GangScheduler(port=kube, is_leader=is_leader, clock=time.time,
                              config=SchedulerConfig(scheduler_name=settings.scheduler_name), metrics=counted)
    kube.on_change = scheduler.notice  # a gang arriving through the pod watch is placed at once
    kube.on_groups_change = scheduler.wake  # ... and one whose PodGroup arrives after its pods
    kube.rest.reach.on_return.append(scheduler.wake)  # ... and a cycle backing off runs when the API server is back
    return scheduler


def start_early(settings: Settings) -> Early | None:
    """On a real cluster: its ports, the Lease taken, and the gang scheduler running, its first cycle ended (or
    ``FIRST_CYCLE_WAIT_S`` passed); None on the simulated one.

    Errors of the cluster's configuration are raised as ``make_kmend`` raises them.
    """
    choice, settings = cluster_choice(settings)
    if choice != "kube":
        return None

    started: list[tuple[LeaderElector | AlwaysLeader, Metrics, GangScheduler | None, SchedulerLoop | None]] = []

    def schedule(cluster: Cluster, leases: Leases) -> None:
        from healer.gang.metrics import HeldMetrics

        leader = make_leader(settings, leases)
        if settings.scheduler is False:
            from kmend.metrics import Metrics

            started.append((leader, Metrics(), None, None))
            return
        built: list[SchedulerLoop] = []
        ready = threading.Event()
        port = kube_pod_scheduling(cluster)

        def lead_then_schedule() -> None:
            # The healer loop renews the Lease once it runs; until then this first acquisition lets the scheduler act.
            # The Lease, and for its holder the first lists and the watches the first cycle reads, are asked for
            # while this thread's caller loads and builds the scheduler (a fifth of a second of imports).
            if leader.tick():
                with contextlib.suppress(ClusterError):  # the scheduler's first cycle lists again, and says why
                    port.changes("")
            ready.wait()
            if built:
                built[0].start()

        threading.Thread(target=lead_then_schedule, name="kmend-early", daemon=True).start()
        held = HeldMetrics()
        try:
            scheduler = kube_gang_scheduler(settings, cluster, leader.is_leader, held, port)
            loop = SchedulerLoop(scheduler, settings.scheduler_interval_s)
            built.append(loop)
        finally:
            ready.set()
        loop.cycled.wait(FIRST_CYCLE_WAIT_S)  # before the Workloads adapter and the rest of the service
        # The registry after the first cycle: prometheus_client's import is not in front of the first bind.
        from healer.gang.metrics import SchedulerMetrics
        from kmend.metrics import Metrics

        metrics = Metrics()
        held.attach(SchedulerMetrics(metrics.registry))
        started.append((leader, metrics, scheduler, loop))

    ports = kube_ports(settings, then=schedule)
    leader, metrics, scheduler, loop = started[0]
    return Early(ports, leader, metrics, scheduler, loop)


FIRST_CYCLE_WAIT_S = 2.0
"""How long start-up lets the gang scheduler's first cycle (its binds answered) run alone before it builds the rest.

The rest of start-up (the generated API classes of the Workloads adapter, the web stack's and the store's imports,
the rules' compiled matcher) is CPU-bound Python: run beside the first cycle, it holds the interpreter's lock while
each bind waits to send and to read its answer, and a gang that waited at start is bound a third of a second later
on a loaded machine. The first cycle is requests and a placement: it ends in tens of milliseconds on a reachable
server, and the wait is bounded for one that is not."""
