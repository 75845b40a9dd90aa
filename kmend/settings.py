"""Service settings: one BaseSettings class, read from KMEND_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from analyzer.packs import default_metric_rules_dir, default_progress_rules_dir, default_rules_dir


class Settings(BaseSettings):
    """Everything the service can be told. Built once by the CLI and passed down."""

    model_config = SettingsConfigDict(env_prefix="KMEND_", env_nested_delimiter="__")

    database_url: str = Field("sqlite:///kmend.db", description="SQLAlchemy URL; postgresql+psycopg://... for replicas")
    rules_dirs: list[Path] = Field(default_factory=lambda: [default_rules_dir()])
    metric_rules_dirs: list[Path] = Field(default_factory=lambda: [default_metric_rules_dir()],
                                          description="metric (NVML/DCGM/IB) and Alertmanager alert rule packs")
    host: str = "127.0.0.1"
    port: int = 8080
    ingest_token: SecretStr | None = Field(None, description="bearer token collectors must send, if set")
    cluster: Literal["auto", "sim", "kube"] = "auto"
    kubeconfig: str | None = None
    in_cluster: bool = False
    event_namespace: str = "default"  # events about namespaced objects; Node events always go to `default`
    sim_nodes: int = 16
    sim_gpus_per_node: int = 8
    dry_run: bool = False
    require_approval: bool = False
    correlation_window_s: float = 1200.0
    symptom_settle_s: float = Field(30.0, description="wait this long for a cause before acting on symptoms")
    incident_quiet_resolve_s: float = Field(21600.0, ge=0, description=(
        "an open incident with no new finding for this long resolves on its own, notify-only ones included "
        "(not while it is remediated or a plan for it is unfinished; 0: never)"))
    healer_interval_s: float = 0.5
    store_lines: Literal["all", "evidence"] = Field("all", description=(
        "log lines of numbered agent batches kept as rows: all, or only those a finding names as evidence "
        "(replays are recognised by batch number either way; unnumbered batches keep every line)"))
    retention_signals_s: float = Field(7 * 86400.0, ge=0, description="keep stored log lines this long (0: for ever)")
    retention_incidents_s: float = Field(90 * 86400.0, ge=0, description=(
        "keep resolved and suppressed incidents and their findings this long (0: for ever)"))
    retention_plans_s: float = Field(90 * 86400.0, ge=0, description="keep finished plans and their steps this long")
    retention_audit_s: float = Field(365 * 86400.0, ge=0, description="keep audit log entries this long (0: for ever)")
    retention_requests_s: float = Field(30 * 86400.0, ge=0, description="keep answered node requests this long")
    progress_rules_dirs: list[Path] = Field(default_factory=lambda: [default_progress_rules_dir()])
    detector_interval_s: float = Field(1.0, description="how often hang/straggler/Flight Recorder detectors run")
    hang_k: float = Field(2.4, description="hang when no progress for k x the job's median report interval "
                                           "(plus its spread; never past max(3 x median, 15 s) - 2 s) ...")
    hang_floor_s: float = Field(13.0, description="... and at least this many seconds")
    hang_hold_k: float = Field(4.0, ge=1.0, description="stacks showing the stalled ranks busy hold a hang finding "
                                                        "at most this many thresholds (1: never)")
    hang_first_steps_timeout_s: float = Field(600.0, gt=0, description=(
        "a job with fewer than three progress reports is called hung at its threshold only when stack dumps "
        "confirm it; otherwise after this many seconds without progress"))
    straggler_min_slowdown: float = Field(1.05, description="slowdown factor a straggler must reach")
    straggler_persistence: int = Field(3, description="consecutive steps a straggler must stay slow")
    flight_recorder_settle_s: float = Field(10.0, description="judge a job's dumps once none arrived for this long")
    notify_webhook_url: str | None = None
    alertmanager_url: str | None = Field(None, description="Alertmanager base URL: notifications POST /api/v2/alerts")
    max_batch_bytes: int = 32 * 1024 * 1024
    max_clock_skew_s: float = Field(300.0, description=(
        "a signal stamped further ahead of the server's clock takes the server's time (the sent time is kept)"))
    ingest_queue_s: float = Field(2.0, ge=0, description=(
        "a batch that would wait longer than this for its turn is answered 503 with Retry-After (0: never)"))
    max_records: int = Field(50_000, description="records one Fluent Bit request may carry (larger: 422)")
    policy_file: Path | None = Field(None, description="healing policy YAML; the shipped default when unset")
    operator_token: SecretStr | None = Field(None, description="bearer token the runbook API requires, if set")
    reader_token: SecretStr | None = Field(None, description="bearer token for GET routes and /metrics (read-only)")
    token_review: bool = Field(False, description="also accept Kubernetes tokens, checked with TokenReview")
    token_review_audiences: list[str] = Field(default_factory=list, description="audiences TokenReview checks")
    token_review_ingest: list[str] = Field(default_factory=list, description="users/groups that may ingest")
    token_review_readers: list[str] = Field(default_factory=list, description="users/groups that may read")
    token_review_operators: list[str] = Field(default_factory=list, description="users/groups that may operate")
    health_check_template: Path | None = Field(None, description="validation Job template (deploy/healthcheck/)")
    namespace: str = Field("kmend-system", description="namespace of kmend's own objects (health checks, Lease)")
    lease_name: str = "kmend-healer"
    scheduler: bool | None = Field(None, description="run the gang scheduler (default: on a real cluster only)")
    scheduler_name: str = Field("kmend", description="pods with this spec.schedulerName are placed by kmend")
    scheduler_interval_s: float = 1.0
    lease_duration_s: int = 15
    replicated: bool = Field(False, description=(
        "several replicas share the PostgreSQL database: each ingests and matches, the Lease holder correlates "
        "and heals"))
    identity: str | None = Field(None, description="this replica's Lease holder identity (default: host name)")
    sim_spares: int = Field(2, description="nodes of the simulated cluster that form the spare pool")
    sim_job_nodes: int = Field(0, description="nodes a simulated PyTorchJob runs on (0: none)")
    sim_checkpoint_path: str = ""
    checkpoint_roots: list[Path] = Field(default_factory=list, description=(
        "directories the control plane mounts and may search for checkpoints (a job's kmend.io/checkpoint-path "
        "under one of them); other local paths are searched by the node agent inside the job's pod, "
        "s3:// gs:// az:// prefixes through fsspec"))
    sim_state_file: Path | None = Field(None, description="keep the simulated cluster in this file across restarts")
    sim_crash_after: int | None = Field(None, description="fault injection: SIGKILL after the N-th applied change")
    sim_crash_before: int | None = Field(None, description="fault injection: SIGKILL before the N-th change lands")

    @model_validator(mode="after")
    def _replicas_share_postgresql(self) -> Settings:
        if self.replicated and not self.database_url.startswith("postgresql"):
            raise ValueError("replicated needs a PostgreSQL database_url (postgresql+psycopg://...): replicas "
                             "share their findings through it")
        return self

    @model_validator(mode="after")
    def _distinct_tokens(self) -> Settings:
        if self.operator_token is not None and self.ingest_token is not None \
                and self.operator_token.get_secret_value() == self.ingest_token.get_secret_value():
            raise ValueError("operator_token must differ from ingest_token: collectors must not run runbooks")
        if self.reader_token is not None and any(
                t is not None and t.get_secret_value() == self.reader_token.get_secret_value()
                for t in (self.ingest_token, self.operator_token)):
            raise ValueError("reader_token must differ from ingest_token and operator_token")
        return self
