"""Service configuration: one Settings object, read from LAYERSWAP_* variables, checked at start.

With nothing set, the service runs on its embedded default: a SQLite file and artifacts under
`./data`, the in-process executor, bound to loopback without authentication.
"""

from __future__ import annotations

import ipaddress
import json
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting's value (a token, a database password) is never
    # echoed into an error message or a log.
    model_config = SettingsConfigDict(
        env_prefix="LAYERSWAP_", frozen=True, hide_input_in_errors=True
    )

    data_dir: Path = Field(Path("data"), description="SQLite file, artifacts and caches")
    database_url: str | None = Field(None, description="default: sqlite:///<data_dir>/layerswap.db")
    executor: Literal["local", "celery"] = Field(
        "local",
        description="where jobs run: local (threads of the API process, one job at a time) or "
        "celery (worker processes fed through the broker)",
    )
    allowed_roots: list[Path] = Field(
        default_factory=list,
        description="local sources must lie under one of these (default: <data_dir>/checkpoints "
        "and the artifacts directory)",
    )
    host: str = Field("127.0.0.1", description="address `layerswap serve` listens on")
    port: int = Field(8000, ge=1, le=65535, description="port `layerswap serve` listens on")
    auth: bool = Field(False, description="require API keys (mandatory off loopback)")
    default_tenant: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
        description="the tenant that owns every job while auth is off",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="with auth on, the bearer token /metrics requires (the operator's scraper; "
        "no tenant's API key reads every tenant's counts); at least 32 characters",
    )
    max_attempts: int = Field(
        3, ge=1, description="starts a job gets: once this many were lost (dead workers), it fails"
    )
    progress_interval_s: float = Field(0.5, gt=0, description="least time between progress writes")
    merge_device: str = Field(
        "cpu", pattern=r"^(cpu|cuda|cuda:[0-9]+)$", description="where a worker's arithmetic runs"
    )
    broker_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis for the celery executor (jobs ids only)"
    )
    broker_visibility_timeout_s: float = Field(
        12 * 3600.0,
        gt=0,
        description="Redis hands a delivered, unacknowledged job id out again after this long "
        "(a backstop: the reconciler finds dead workers sooner, and a repeat does nothing)",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="how often a running job proves it is alive (and sees a cancel)"
    )
    cancel_check_interval_s: float = Field(
        0.25,
        gt=0,
        description="a running job reads its cancel flag from the database at most this often "
        "(one primary-key read per running job), so a cancel stops it within about this long",
    )
    stale_after_s: float = Field(
        30.0, gt=0, description="a running job silent this long is presumed dead and re-queued"
    )
    reconcile_interval_s: float = Field(
        5.0, gt=0, description="how often the service looks for lost messages and dead jobs"
    )
    worker_watchdog_s: float = Field(
        10.0,
        gt=0,
        description="how often a celery worker checks that it is still taking messages "
        "(worker/watchdog.py); idle twice in a row with messages waiting, it reconnects",
    )
    hub_credentials: dict[str, dict[str, SecretStr]] = Field(
        default_factory=dict,
        description='Hub tokens per tenant and name, JSON: {"<tenant>": {"<name>": "hf_..."}}; '
        "a request names one of its own tenant's",
    )
    db_retry_s: float = Field(
        60.0, ge=0, description="how long a job keeps retrying its final write to the database"
    )
    max_request_bytes: int = Field(
        1024 * 1024, ge=1, description="largest request body; larger ones are refused unread (413)"
    )
    max_json_depth: int = Field(
        64,
        ge=2,
        le=200,
        description="deepest nesting of arrays and objects a JSON body may have; deeper ones are "
        "refused unparsed (422 naming the body)",
    )
    max_stored_request_bytes: int = Field(
        256 * 1024,
        ge=1024,
        description="largest request a job or sweep stores, as JSON (a mergekit config's "
        "record and its translation included); a submit that would store more is refused "
        "(413 request_too_large naming the field)",
    )
    trusted_hosts: list[str] | None = Field(
        None,
        description="JSON list of names the Host (and any Origin) header may carry; '*' for any "
        "(default: localhost, 127.0.0.1, ::1 and LAYERSWAP_HOST unless it is a wildcard)",
    )
    # Connections (`layerswap serve`): a client that trickles its request is cut off, and the
    # number of connections per process is bounded, so slow clients cannot use up its file
    # descriptors (which its database connections and checkpoint reads need too).
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's head (request line and headers) must arrive within this long "
        "of the connection opening, or of its first byte on a kept-alive connection; else "
        "408 and the connection is closed",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request's body must arrive in full within this long of its head; else "
        "408 and the connection is closed",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="connections one API process holds open; while that many are open (or as "
        "many requests are being answered) a request is answered 503, and a further "
        "connection is answered 503 and closed at once",
    )
    forwarded_allow_ips: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="addresses or networks of the reverse proxies whose X-Forwarded-For and "
        "X-Forwarded-Proto are believed (JSON list or comma-separated; '*' for any peer). "
        "Default: none, so the client is the connection's own peer",
    )
    sse_max_seconds: float = Field(
        900.0, gt=0, description="an event stream ends after this long (the client resumes)"
    )
    sse_streams_per_tenant: int = Field(
        8, ge=1, description="concurrent event streams a tenant may hold open per API process"
    )
    stop_timeout_s: int = Field(
        5,
        ge=0,
        description="on a stop (SIGTERM), how long `layerswap serve` lets the requests in progress "
        "finish (long polls and event streams would hold it for minutes) before it cuts them "
        "and exits; keep it under the grace period of whatever stops it (Docker's: 10 s)",
    )
    # Storage: what one tenant may make the service store (core/quota.py,
    # engine/plan/output_size.py).
    tenant_quota_bytes: int = Field(
        100 * 1024**3,
        ge=0,
        description="bytes a tenant may store: its live outputs and analyses plus the database "
        "records of its jobs, sweeps and webhooks. The default, 100 GiB, bounds each tenant of a "
        "small deployment (a few 7B merges at ~15 GB each) so one cannot fill the disk shared "
        "by all; 0 means unlimited, for an operator who bounds storage otherwise",
    )
    max_output_ratio: float = Field(
        4.0,
        ge=1,
        description="a merge's output may be at most this many times the size of its distinct "
        "inputs (checked from headers at submit and again before writing; 422 "
        "output_too_large). 4 lets a passthrough repeat layers (32 to 48: 1.5x), a union "
        "vocabulary grow the embeddings and bfloat16 become float32 (2x), together",
    )
    quota_records_refresh_s: float = Field(
        10.0,
        ge=0,
        description="a tenant's database bytes (a sum over all its jobs) are summed again after "
        "this long; in between each API process reuses its last sum (0: at every check)",
    )
    eval_tasks_dir: Path | None = Field(
        None, description="extra lm-eval task YAMLs (air-gapped deployments), beside lm-eval's own"
    )
    eval_data_dir: Path | None = Field(
        None,
        description="local evaluation data, e.g. mgsm/<lang>/test.jsonl (default: "
        "<data_dir>/eval-data)",
    )
    eval_timeout_s: float = Field(
        6 * 3600.0, gt=0, description="an evaluation running longer fails (evaluation_timeout)"
    )
    eval_backends: list[Literal["hf", "vllm"]] = Field(
        ["hf"],
        description="lm-eval backends the workers offer; vllm needs GPU workers with vllm",
    )

    public_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
        description="this API's address as clients reach it; webhook links are made absolute "
        "with it (default: paths only)",
    )
    webhook_allowed_networks: list[str] = Field(
        default_factory=list,
        description="JSON list of CIDRs webhooks may reach although not public, e.g. "
        '["10.20.0.0/16"] (default: public addresses only)',
    )
    webhook_timeout_s: float = Field(
        10.0, gt=0, le=60, description="one webhook attempt, all of it: connect, send, the answer"
    )
    webhook_retry_base_s: float = Field(
        5.0, gt=0, description="first retry delay; each next one is 3× (jittered, at most 12 h)"
    )
    webhook_retry_window_s: float = Field(
        3 * 24 * 3600.0, gt=0, description="a webhook not delivered this long after its event fails"
    )
    webhook_interval_s: float = Field(
        1.0, gt=0, description="how often each API process looks for webhooks due"
    )
    webhook_max_endpoints: int = Field(
        50, ge=1, description="webhook endpoints a tenant may have at once"
    )
    webhook_concurrency: int = Field(
        32, ge=1, description="webhook attempts in flight at once, per API process"
    )
    webhook_tenant_concurrency: int = Field(
        4, ge=1, description="of those, at most this many for one tenant (the rest wait)"
    )
    webhook_secret_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Fernet keys that encrypt webhook signing secrets at rest, newest first "
        "(JSON list or comma-separated); the first encrypts, all decrypt. Default: a key the "
        "service makes in <data_dir>/webhook-secrets.key",
    )
    webhook_secret_overlap_s: float = Field(
        24 * 3600.0,
        ge=0,
        le=7 * 24 * 3600.0,
        description="after a secret rotation, the old secret also signs for this long",
    )

    openlineage_url: str | None = Field(
        None,
        pattern=r"^https?://",
        description="send OpenLineage run events to this backend (http transport, "
        "/api/v1/lineage); unset: the client's own OPENLINEAGE_URL / OPENLINEAGE_CONFIG, if any",
    )
    openlineage_namespace: str = Field(
        "layerswap", min_length=1, max_length=200, description="the namespace of OpenLineage jobs"
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        pattern=r"^(https?|databricks)",
        description="the MLflow tracking server whose Model Registry merges with output.mlflow "
        "are registered in",
    )
    # Outside systems never hold a job for long: each call has a deadline for the whole of it.
    openlineage_timeout_s: float = Field(
        10.0, gt=0, le=300,
        description="the longest sending one OpenLineage event may take, retries included; "
        "then it is abandoned (logged), the job unaffected",
    )  # fmt: skip
    mlflow_timeout_s: float = Field(
        120.0, gt=0, le=3600,
        description="the longest registering a merge in MLflow (or tagging its scores) may "
        "take, retries included; then it fails with mlflow_failed",
    )  # fmt: skip
    hub_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="a Hub request that gets no answer for this long, or is answered slower "
        "than hub_min_bytes_per_s over this long, fails with hub_timeout",
    )  # fmt: skip
    hub_min_bytes_per_s: int = Field(
        1024, ge=1, description="the slowest answer from the Hub a request waits for"
    )

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"not a network: {network!r} (e.g. 10.0.0.0/8)") from None
        return value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxies(cls, value: list[str]) -> list[str]:
        """Written as uvicorn compares them: it takes anything it cannot parse, a network
        with host bits set included, for a name no peer has; '*' only when alone."""
        if "*" in value:
            return ["*"]
        try:
            return [
                str(ipaddress.ip_network(proxy, strict=False) if "/" in proxy
                    else ipaddress.ip_address(proxy))
                for proxy in value
            ]  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{e} (e.g. 10.0.0.5 or 10.0.0.0/8)") from None

    @field_validator("webhook_secret_keys", "forwarded_allow_ips", mode="before")
    @classmethod
    def _key_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
        return value

    @field_validator("metrics_token")
    @classmethod
    def _operator_token(cls, value: SecretStr | None) -> SecretStr | None:
        token = value.get_secret_value() if value is not None else ""
        if value is not None and not token:
            return None  # set but empty, as a compose file passes an unset variable on: none
        if value is not None and (len(token) < 32 or token.startswith("lsk_")):
            raise ValueError(
                "must be at least 32 characters (e.g. `openssl rand -hex 32`) and not an API "
                "key (lsk_...)"
            )
        return value

    @field_validator("hub_credentials", mode="before")
    @classmethod
    def _credentials_per_tenant(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = json.loads(value)
        if isinstance(value, dict) and any(not isinstance(v, dict) for v in value.values()):
            raise ValueError(
                'must map each tenant to its credentials: {"<tenant>": {"<name>": "hf_..."}} '
                "(the flat {name: token} form let any tenant use any token and is refused)"
            )
        return value

    @model_validator(mode="after")
    def _safe_binding(self) -> Self:
        if not self.auth and not _is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without authentication: set LAYERSWAP_AUTH=true"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_fits(self) -> Self:
        if self.stale_after_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                "stale_after_s must be more than twice heartbeat_interval_s, or live jobs "
                "would be taken for dead"
            )
        return self

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'layerswap.db').absolute()}"

    @property
    def allowed_hosts(self) -> set[str]:
        """The trusted Host names, lower-case; {'*'} trusts every name."""
        if self.trusted_hosts is not None:
            return {host.lower() for host in self.trusted_hosts}
        hosts = {"localhost", "127.0.0.1", "::1"}
        if self.host not in ("0.0.0.0", "::", ""):  # a wildcard bind names no host
            hosts.add(self.host.lower())
        return hosts

    @property
    def artifacts_dir(self) -> Path:
        return (self.data_dir / "artifacts").absolute()

    @property
    def cache_dir(self) -> Path:
        return (self.data_dir / "cache").absolute()

    @property
    def evaluation_data_dir(self) -> Path:
        return (self.eval_data_dir or self.data_dir / "eval-data").absolute()

    @property
    def evaluations_dir(self) -> Path:
        """Per-sample records and request caches of evaluations (not merge outputs)."""
        return (self.data_dir / "evaluations").absolute()

    @cached_property
    def source_roots(self) -> list[Path]:
        """The allowed roots with symlinks resolved, once: they are configuration (resolving
        them for each source of each submit was ~5 % of its time, py-spy)."""
        roots = self.allowed_roots or [self.data_dir / "checkpoints", self.artifacts_dir]
        return [root.resolve() for root in roots]

    @cached_property
    def resolved_artifacts_dir(self) -> Path:
        return self.artifacts_dir.resolve()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
