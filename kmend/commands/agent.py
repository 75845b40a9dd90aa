"""`kmend agent`: the node agent (DaemonSet). Wires sources, prefilter, spool and shipper.

This is the composition root for the node: it may read the rule packs (to build
the prefilter) and hand the collector plain regular expressions, so the
collector itself never imports the analyzer.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from analyzer.exact import hyperscan_pattern
from analyzer.progress import ProgressExtractor
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.rules import RuleError, context_patterns, default_rules_dir, load_rules
from collector.agent import Agent
from collector.checkpoint import CheckpointStore
from collector.container_fs import FindCheckpointHandler
from collector.flight_recorder import DEFAULT_PREFIXES, FlightRecorderSource, HttpDumpUploader
from collector.gpu_query import GpuQueryHandler
from collector.gpu_reset import GpuResetHandler, load_reset_nvml
from collector.httpserver import start_status_server
from collector.metrics import AgentMetrics
from collector.node_requests import HttpNodeRequestClient, NodeRequestRunner, RequestHandler, RequestJournal
from collector.podmeta import FilePodMetadata, KubeApiPodMetadata, PodMetadataProvider
from collector.prefilter import RegexPrefilter
from collector.processes import ProcessFinder
from collector.progress_file import ProgressFileSource
from collector.progress_summary import ExitsAfterSteps, LineStep, ProgressWindows, SummarisedProgress
from collector.shipper import Shipper
from collector.signal import LogLine, ProgressSample, Signal
from collector.sources.base import SignalSource
from collector.sources.cri import CriLogSource
from collector.sources.dcgm import DcgmSource, http_fetcher
from collector.sources.ib import IbSysfsSource
from collector.sources.kernel import KernLogSource, KmsgSource
from collector.sources.nvml import NvmlSource
from collector.sources.procs import PodRanks, ProcessExitSource
from collector.spool import DiskSpool, Value
from collector.stacks import PySpyDumper, StackRequestResponder
from collector.survey import PySpyProfiler, StackSurvey
from collector.validate import node_name_problem
from healer.checkpoint_remote import discover_json
from kmend.errors import ConfigError, from_validation

log = logging.getLogger("kmend.agent")


class AgentSettings(BaseSettings):
    """Everything the agent can be told; KMEND_AGENT_* environment variables or flags."""

    model_config = SettingsConfigDict(env_prefix="KMEND_AGENT_", populate_by_name=True)

    node: str = Field(default_factory=socket.gethostname,
                      validation_alias=AliasChoices("node", "KMEND_AGENT_NODE", "NODE_NAME"),
                      description="this node's name (the DaemonSet sets NODE_NAME from the downward API)")
    service_url: str = "http://kmend.kmend-system.svc:8080"
    token: SecretStr | None = Field(None, description="bearer token for the service")
    token_file: Path | None = Field(None, description="file holding the token (a mounted Secret)")
    state_dir: Path = Path("/var/lib/kmend-agent")
    spool_max_bytes: int = 256 * 1024 * 1024
    batch_size: int = Field(1000, ge=1, le=50000)
    flush_interval: float = Field(1.0, gt=0)
    poll_interval: float = Field(0.5, gt=0)
    pods_root: Path = Path("/var/log/pods")
    kernel: Literal["kmsg", "file", "off"] = "kmsg"
    kmsg_path: Path = Path("/dev/kmsg")
    kern_log: Path = Path("/var/log/kern.log")
    boot_id_path: Path = Path("/proc/sys/kernel/random/boot_id")
    ib_root: Path = Path("/sys/class/infiniband")
    nvml: bool = True
    dcgm_url: str | None = Field(None, description="DCGM exporter /metrics URL, e.g. http://localhost:9400/metrics")
    metrics_interval: float = Field(15.0, gt=0, description="seconds between NVML/DCGM/IB samples")
    flight_recorder_dir: Path | None = Field(None, description="host directory the training pods' "
                                             "TORCH_FR_DUMP_TEMP_FILE points into")
    flight_recorder_prefixes: list[str] = Field(default_factory=lambda: list(DEFAULT_PREFIXES), min_length=1,
                                                description="file-name part of TORCH_FR_DUMP_TEMP_FILE")
    flight_recorder_settle_s: float = Field(5.0, ge=0, description="a dump unchanged this long is complete")
    prefilter: bool = Field(True, description="ship only lines a rule could match (plus all metrics)")
    prefilter_extra: list[str] = Field(default_factory=list, description="more patterns to ship")
    rules_dirs: list[Path] = Field(default_factory=lambda: [default_rules_dir()])
    progress_rules_dirs: list[Path] = Field(default_factory=lambda: [default_progress_rules_dir()],
                                            description="progress rule packs: lines they match pass the prefilter")
    progress_dir: Path | None = Field(None, description="directory of report_step JSON lines ($KMEND_PROGRESS_DIR "
                                                        "of the training pods, a hostPath)")
    progress_summary_s: float = Field(5.0, ge=0, description="seconds between the per-rank progress summaries "
                                                              "shipped instead of every step's sample (0: all)")
    pod_labels: bool = Field(True, description="look up job and rank in pod labels (in-cluster only)")
    node_requests: bool = Field(True, description="poll the service for GPU resets and checkpoint searches")
    request_interval: float = Field(5.0, gt=0, description="seconds between polls of the node's requests (GPU "
                                                           "resets, checkpoint searches, stack dumps on a hang)")
    gpu_reset: bool = Field(True, description="carry out GPU resets (needs NVML, nvidia-smi and root)")
    nvidia_smi: str = Field("nvidia-smi", description="nvidia-smi binary used for --gpu-reset and GPU evidence")
    gpu_idle_timeout_s: float = Field(600.0, gt=0, description="how long a reset waits for the GPU to go idle")
    proc_root: Path = Field(Path("/proc"), description="the host's /proc (hostPID): pods' filesystems are read "
                                                       "through /proc/<pid>/root")
    pod_labels_file: Path | None = Field(None, description="JSON or YAML file mapping 'namespace/pod' (or 'pod') to "
                                                           "its labels, for nodes without API access")
    job: str | None = Field(None, description="job name for every pod on this node (off-cluster, one job per node)")
    stacks: bool = Field(True, description="answer the service's stack_dump requests with py-spy (needs host PID "
                                           "namespace and SYS_PTRACE)")
    process_exits: bool = Field(True, description="watch training processes in the host's /proc (hostPID): a job "
                                                  "whose rank processes all ended has finished, its silence no hang")
    py_spy: str = Field("py-spy", description="py-spy executable (name on PATH or path)")
    stack_survey_s: float = Field(10.0, ge=0, description="seconds between stack surveys of the node's rank "
                                                          "processes (py-spy --nonblocking, 2 s each, never pausing "
                                                          "them): the rank its peers wait for is a straggler (0: off)")
    status_host: str = "0.0.0.0"
    status_port: int = 9401

    @field_validator("node")
    @classmethod
    def _kubernetes_node_name(cls, node: str) -> str:
        # The service refuses every batch from a node name Kubernetes could not have: say so at start.
        if (why := node_name_problem(node)) is not None:
            raise ValueError(f"{node[:80]!r} {why} (set NODE_NAME or KMEND_AGENT_NODE to the node's name)")
        return node

    def bearer(self) -> str | None:
        """The token, from the file when one is given (re-read at start)."""
        if self.token_file is not None:
            try:
                return self.token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"KMEND_AGENT_TOKEN_FILE={str(self.token_file)!r}: cannot read the token: "
                                  f"{exc.strerror}") from None
        return self.token.get_secret_value() if self.token else None


def build_prefilter(settings: AgentSettings) -> RegexPrefilter | None:
    """The rule packs' patterns as a prefilter; rules are validated here, so a bad pack stops start-up.

    Progress rules are included: the service's hang and straggler detectors read
    trainers' step lines (Megatron iterations, Trainer dicts, tqdm bars), which no
    fault rule matches.
    """
    if not settings.prefilter:
        return None
    try:
        rules = load_rules(settings.rules_dirs)
        progress = load_progress_rules(settings.progress_rules_dirs)
    except RuleError as exc:
        raise ConfigError(f"KMEND_AGENT_RULES_DIRS / KMEND_AGENT_PROGRESS_RULES_DIRS: {exc}") from None
    # As the service's hyperscan database holds them: "$" also before a "\r" (CRLF files), "\S" also the
    # vertical tab. A prefilter may only widen what the rules match, never narrow it.
    # Context lines that make a finding benign (a requested kubelet stop) travel with the rules' own.
    patterns = ([r.pattern for r in rules] + context_patterns(rules) + [r.regex.pattern for r in progress]
                + list(settings.prefilter_extra))
    return RegexPrefilter([hyperscan_pattern(p) for p in patterns])


def build_line_steps(settings: AgentSettings, ranks: PodRanks | None = None) -> LineStep | None:
    """Trainers' step lines summarised on the node, as hook progress is (None: summaries off, or no progress rules).

    The service's own progress rules decide what a step is. A line a fault rule may also match goes on as a line,
    and so does any progress line whose meaning depends on what came before (counted steps, pauses, the end):
    the service reads those itself. `ranks` learns which ranks each pod's step lines name.
    """
    if settings.progress_summary_s <= 0:
        return None
    progress = load_progress_rules(settings.progress_rules_dirs)
    if not progress:
        return None
    rules = load_rules(settings.rules_dirs)
    faults = RegexPrefilter([hyperscan_pattern(p) for p in [r.pattern for r in rules] + context_patterns(rules)])
    extractor = ProgressExtractor(progress)

    def step(line: LogLine) -> ProgressSample | bool:
        got = extractor.edge_step(line)
        if isinstance(got, ProgressSample):
            if ranks is not None:
                ranks.note(line, got)
            if faults.matches(line.text):
                return True
        return got

    return step


def build_value_of(settings: AgentSettings) -> Callable[[Signal], Value]:
    """What a signal is worth keeping through an outage: lines a cause rule matches (an Xid) over lines
    other fault rules match (the symptoms), over everything else (progress lines, metrics)."""
    rules = load_rules(settings.rules_dirs)
    causes = RegexPrefilter([r.pattern for r in rules if not r.symptom_of], use_hyperscan=False)
    faults = RegexPrefilter([r.pattern for r in rules if r.symptom_of], use_hyperscan=False)

    def value_of(sig: Signal) -> Value:
        text = sig.payload.text if isinstance(sig.payload, LogLine) else None
        if text is None:
            return Value.TELEMETRY
        if causes.matches(text):
            return Value.CAUSE
        return Value.SYMPTOM if faults.matches(text) else Value.TELEMETRY

    return value_of


def pod_metadata(settings: AgentSettings) -> PodMetadataProvider | None:
    """Where pod labels come from: the labels file when given, else the API server in a cluster.

    Without either, job and rank come from the pod name and the lines' rank prefixes.
    """
    if settings.pod_labels_file is not None:
        try:
            return FilePodMetadata(settings.pod_labels_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"KMEND_AGENT_POD_LABELS_FILE={str(settings.pod_labels_file)!r} (--pod-labels-file): "
                              f"{exc}") from None
    return KubeApiPodMetadata.in_cluster() if settings.pod_labels else None


def _py_spy(name: str) -> str | None:
    # Installed with kmend, py-spy sits beside the interpreter even when that directory is not on PATH.
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def build_agent(settings: AgentSettings, *, metrics: AgentMetrics | None = None) -> Agent:
    """An agent for these settings, resuming from the checkpoint in ``state_dir``."""
    metrics = metrics or AgentMetrics()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = CheckpointStore(settings.state_dir / "checkpoints.json")
    if checkpoints.recovered:
        log.warning("checkpoint file was unreadable; re-reading logs (the service drops repeats)")
    prefilter = build_prefilter(settings)
    node = settings.node
    sources: list[SignalSource] = []
    meta = pod_metadata(settings)
    containers: SignalSource = CriLogSource(node=node, root=settings.pods_root, pod_metadata=meta,
                                            prefilter=prefilter, resume=checkpoints.section("container"),
                                            job=settings.job)
    pod_ranks = PodRanks()
    line_steps = build_line_steps(settings, pod_ranks)
    step_windows: ProgressWindows | None = None
    if line_steps is not None:
        # Step lines leave as one summary per rank every progress_summary_s, like the hook's samples.
        summarised = SummarisedProgress(containers, settings.progress_summary_s, from_lines=line_steps)
        containers, step_windows = summarised, summarised.windows
    sources.append(containers)
    if settings.kernel == "kmsg":
        try:
            sources.append(KmsgSource(node=node, path=settings.kmsg_path, boot_id_path=settings.boot_id_path,
                                      resume=checkpoints.section("kernel"), prefilter=prefilter))
        except OSError as exc:
            log.warning("kernel log unavailable (%s): %s", settings.kmsg_path, exc)
    elif settings.kernel == "file":
        sources.append(KernLogSource(node=node, path=settings.kern_log, resume=checkpoints.section("kernel"),
                                     prefilter=prefilter))
    if settings.progress_dir is not None:
        # Added even before the directory exists: the first training pod creates it.
        progress: SignalSource = ProgressFileSource(settings.progress_dir, node, resume=checkpoints.section("progress"),
                                                    pod_metadata=meta, job=settings.job)
        if settings.progress_summary_s > 0:
            progress = SummarisedProgress(progress, settings.progress_summary_s)
        sources.append(progress)
    if settings.flight_recorder_dir is not None:
        uploader = HttpDumpUploader(settings.service_url, token=settings.bearer())
        sources.append(FlightRecorderSource(node=node, root=settings.flight_recorder_dir, uploader=uploader,
                                            prefixes=settings.flight_recorder_prefixes, pod_metadata=meta,
                                            resume=checkpoints.section("flight-recorder"),
                                            settle_s=settings.flight_recorder_settle_s))
    if settings.process_exits and settings.proc_root.is_dir():
        # Pods that ended before the agent started are told by the ranks their step lines named (summaries on).
        exits: SignalSource = ProcessExitSource(node=node, finder=ProcessFinder(
            proc_root=settings.proc_root, pods_root=settings.pods_root, pod_metadata=meta, job=settings.job),
            ranks=pod_ranks if step_windows is not None else None)
        sources.append(exits if step_windows is None else ExitsAfterSteps(exits, step_windows))
    survey = settings.stack_survey_s > 0 and settings.stacks and settings.proc_root.is_dir()
    if survey and (binary := _py_spy(settings.py_spy)) is not None:
        sources.append(StackSurvey(node=node, profiler=PySpyProfiler(binary), every_s=settings.stack_survey_s,
                                   finder=ProcessFinder(proc_root=settings.proc_root, pods_root=settings.pods_root,
                                                        pod_metadata=meta, job=settings.job),
                                   proc_root=settings.proc_root))
    if settings.ib_root.is_dir():
        sources.append(IbSysfsSource(node=node, root=settings.ib_root, interval=settings.metrics_interval))
    if settings.nvml:
        nvml = NvmlSource(node=node, interval=settings.metrics_interval)
        if nvml.available:
            sources.append(nvml)
    if settings.dcgm_url:
        sources.append(DcgmSource(node=node, fetch=http_fetcher(settings.dcgm_url),
                                  interval=settings.metrics_interval))
    spool = DiskSpool(settings.state_dir / "spool", max_bytes=settings.spool_max_bytes)
    # A new producer name per start: the batch numbers begin again at 1 without being taken for replays,
    # and the spool's batches from before keep the name and numbers they were sent with.
    shipper = Shipper(url=settings.service_url, token=settings.bearer(), spool=spool, metrics=metrics,
                      value_of=build_value_of(settings), producer=f"{node}/{secrets.token_hex(6)}")
    log.info("agent on %s: sources %s, prefilter %s", node, [s.name for s in sources],
             prefilter.engine if prefilter else "off")
    return Agent(sources=sources, shipper=shipper, checkpoints=checkpoints, metrics=metrics,
                 batch_size=settings.batch_size, flush_interval=settings.flush_interval,
                 poll_interval=settings.poll_interval)


def build_request_runner(settings: AgentSettings) -> NodeRequestRunner | None:
    """The node-request runner: GPU resets where NVML answers, checkpoint searches in pods' filesystems."""
    if not settings.node_requests:
        return None
    handlers: dict[str, RequestHandler] = {}
    if settings.gpu_reset:
        try:
            nv = load_reset_nvml()
            nv.nvmlInit()
            nv.nvmlShutdown()
            handlers["reset_gpu"] = GpuResetHandler(load_nvml=load_reset_nvml, nvidia_smi=settings.nvidia_smi,
                                                    idle_timeout_s=settings.gpu_idle_timeout_s)
        except Exception as exc:
            log.info("GPU reset not offered on this node (NVML unavailable: %s)", exc)
    # Read-only and cheap: offered everywhere; a node without nvidia-smi answers that it has none.
    handlers["gpu_query"] = GpuQueryHandler(nvidia_smi=settings.nvidia_smi)
    handlers["find_checkpoint"] = FindCheckpointHandler(proc_root=settings.proc_root, discover=discover_json)
    if settings.stacks:
        binary = _py_spy(settings.py_spy)
        if binary is None:
            log.warning("py-spy not found (%s): stack_dump requests are not answered", settings.py_spy)
        else:
            finder = ProcessFinder(proc_root=settings.proc_root, pods_root=settings.pods_root,
                                   pod_metadata=pod_metadata(settings), job=settings.job)
            handlers["stack_dump"] = StackRequestResponder(url=settings.service_url, node=settings.node,
                                                           finder=finder, dumper=PySpyDumper(binary),
                                                           token=settings.bearer(), clock=time.monotonic)
    client = HttpNodeRequestClient(settings.service_url, token=settings.bearer())
    return NodeRequestRunner(node=settings.node, client=client, interval=settings.request_interval,
                             journal=RequestJournal(settings.state_dir / "requests.json"), handlers=handlers)


_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--node", {"help": "node name (NODE_NAME)"}),
    ("--service-url", {"help": "kmend service base URL (KMEND_AGENT_SERVICE_URL)"}),
    ("--token-file", {"type": Path, "help": "file with the bearer token (KMEND_AGENT_TOKEN_FILE)"}),
    ("--state-dir", {"type": Path, "help": "checkpoints and spool (KMEND_AGENT_STATE_DIR)"}),
    ("--spool-max-bytes", {"type": int, "help": "spool cap; oldest batches dropped past it"}),
    ("--batch-size", {"type": int, "help": "signals per POST"}),
    ("--flush-interval", {"type": float, "help": "seconds between POSTs when batches are small"}),
    ("--poll-interval", {"type": float, "help": "seconds between reads of the sources"}),
    ("--pods-root", {"type": Path, "help": "CRI container logs (/var/log/pods)"}),
    ("--kernel", {"choices": ["kmsg", "file", "off"], "help": "kernel log from /dev/kmsg or kern.log"}),
    ("--kmsg-path", {"type": Path, "help": "kmsg device"}),
    ("--kern-log", {"type": Path, "help": "kern.log file (with --kernel file)"}),
    ("--ib-root", {"type": Path, "help": "InfiniBand sysfs root"}),
    ("--dcgm-url", {"help": "DCGM exporter /metrics URL"}),
    ("--flight-recorder-dir", {"type": Path, "help": "Flight Recorder dumps to upload"}),
    ("--progress-dir", {"type": Path, "help": "report_step progress files (KMEND_AGENT_PROGRESS_DIR)"}),
    ("--progress-summary-s", {"type": float, "help": "seconds between per-rank progress summaries (0: ship every "
                                                     "step's sample)"}),
    ("--pod-labels-file", {"type": Path, "help": "JSON/YAML: 'namespace/pod' -> labels (off-cluster job and rank)"}),
    ("--job", {"help": "job name of every pod on this node (default: from labels or the pod name)"}),
    ("--metrics-interval", {"type": float, "help": "seconds between GPU/NIC samples"}),
    ("--status-port", {"type": int, "help": "port of /metrics and /healthz (0: off)"}),
    ("--status-host", {"help": "address of /metrics and /healthz"}),
    ("--request-interval", {"type": float, "help": "seconds between polls for GPU resets and checkpoint searches"}),
    ("--nvidia-smi", {"help": "nvidia-smi binary for GPU resets"}),
    ("--gpu-idle-timeout-s", {"type": float, "help": "how long a GPU reset waits for the GPU to go idle"}),
    ("--proc-root", {"type": Path, "help": "the host's /proc (pods' filesystems for checkpoint searches)"}),
    ("--py-spy", {"help": "py-spy executable for stack dumps on a suspected hang"}),
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    p = sub.add_parser("agent", help="run the node agent (collect and ship signals)")
    for flag, kw in _FLAGS:
        p.add_argument(flag, **kw)
    p.add_argument("--no-prefilter", dest="prefilter", action="store_false", default=None,
                   help="ship every log line, not only rule candidates")
    p.add_argument("--no-nvml", dest="nvml", action="store_false", default=None, help="do not use NVML")
    p.add_argument("--no-pod-labels", dest="pod_labels", action="store_false", default=None,
                   help="do not ask the API server for pod labels")
    p.add_argument("--no-node-requests", dest="node_requests", action="store_false", default=None,
                   help="do not poll for GPU resets and checkpoint searches")
    p.add_argument("--no-gpu-reset", dest="gpu_reset", action="store_false", default=None,
                   help="never reset a GPU on this node")
    p.add_argument("--no-stacks", dest="stacks", action="store_false", default=None,
                   help="do not capture Python stacks of training processes on a suspected hang")
    p.add_argument("--no-process-exits", dest="process_exits", action="store_false", default=None,
                   help="do not watch training processes in /proc for their end")
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace) -> AgentSettings:
    """Environment first, flags override."""
    keys = [f.lstrip("-").replace("-", "_") for f, _ in _FLAGS] + [
        "prefilter", "nvml", "pod_labels", "node_requests", "gpu_reset", "stacks", "process_exits"]
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    try:
        return AgentSettings(**overrides)
    except ValidationError as exc:
        raise from_validation(exc, prefix="KMEND_AGENT_",
                              flags={k: "--" + k.replace("_", "-") for k in overrides}) from None


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT; the last batch is flushed on the way out."""
    settings = settings_from(args)
    metrics = AgentMetrics()
    agent = build_agent(settings, metrics=metrics)
    runner = build_request_runner(settings)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = None
    if settings.status_port:
        server = start_status_server(metrics.registry, agent.healthy, host=settings.status_host,
                                     port=settings.status_port)
    if runner is not None:
        log.info("node requests: carrying out %s", ", ".join(runner.capabilities))
        threading.Thread(target=runner.run, args=(stop,), name="node-requests", daemon=True).start()
    try:
        agent.run(stop)
    finally:
        if server is not None:
            server.shutdown()
    return 0
