"""Gateway settings: one pydantic-settings object, built once at start-up and passed down.

Sources, highest priority first: keyword arguments, environment variables (prefix ``SLOGATE_``,
nested keys joined with ``__``; lists and objects as JSON), then the YAML file given with
``--config``. An engine's ``api_key_env`` names one more variable, read when the settings load.
Nothing reads the environment at import time.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import re
import secrets
import socket
import sys
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from policies.api import Role
from policies.outliers import OutlierParams
from profiles import PROFILES_DIR as DEFAULT_PROFILES_DIR

_log = logging.getLogger("slogate.settings")

EngineKind = Literal["vllm", "sglang", "sim", "openai", "llamacpp"]
KvTransfer = Literal["nixl", "bootstrap", "shared"]

#: settings whose values (or, for mappings, whose keys) are API keys: never printed
#: the keep-alive of the engines' servers (vLLM's and SGLang's uvicorn: 5 s): the gateway's pool
#: closes an idle connection before an engine does, never reusing one the engine is closing
ENGINE_KEEPALIVE_S = 5.0

SECRET_FIELDS = frozenset(
    {
        "api_keys",
        "admin_api_keys",
        "api_key_policies",
        "api_key_tasks",
        "api_key_tenants",
        "otlp_headers",
        "redis_url",  # (may carry the server's password)
    }
)


#: from a scheme to the last ``@`` before the next blank or quote (a password may hold ``/`` or ``@``)
_URL_CREDENTIALS = re.compile(r"(?<=://)[^\s'\"]*@")


def without_credentials(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it replaced by ``***@`` (engine
    and OTLP URLs may carry credentials; the admin API and error messages show them so)."""
    return _URL_CREDENTIALS.sub("***@", text)


def _without_userinfo(value: str) -> str:
    """A rejected URL-like value without what precedes its last ``@`` (a URL without its scheme
    still carries ``user:password@``)."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    if "@" in rest:  # (up to the last one: a password may hold "/" or "@")
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def key_fingerprint(key: str) -> str:
    """A stable, non-reversible name for an API key, safe for logs and error messages.

    A hash rather than the key's last characters: short keys (tests, dev set-ups) would be shown
    whole by any ``...abcd`` scheme.
    """
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _check_key(key: str, where: str) -> str:
    # A key with whitespace or control characters can never arrive intact in a Bearer header,
    # so it would silently never match; refuse it at start-up instead.
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{where}: an API key must be non-empty printable text without whitespace")
    return key


class ApiKeyPolicy(BaseModel):
    """What one client key may ask for: its tenant, its task and how urgent it may claim to be.

    The fields are ceilings on the client's own claims, applied before classification: a more
    urgent ``x-priority`` than ``max_priority`` (0 is the most urgent) is lowered to it, explicit
    TTFT/TPOT targets tighter than the minimums are raised to them, and ``x-slo-task`` replaces
    ``task`` only when ``task_override`` allows it (without a ``task`` the client's stands).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    tenant: str | None = Field(default=None, min_length=1)
    task: str | None = Field(default=None, min_length=1, description="default task (SLO class)")
    task_override: bool = Field(default=False, description="x-slo-task may replace the key's task")
    max_priority: int | None = Field(default=None, ge=0, description="most urgent priority allowed")
    min_ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min_tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    decisions: bool = Field(
        default=False,
        description="x-slogate-debug is answered with the routing decision, which shows how much of "
        "the prompt each engine holds cached (prefix roots are not per tenant)",
    )


class EngineConfig(BaseModel):
    """One upstream engine as a user declares it."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True, allow_inf_nan=False)

    url: HttpUrl
    kind: EngineKind = "vllm"
    model: str = Field(min_length=1, description="served model name clients ask for")
    role: Role = Role.COLLOCATED
    weight: float = Field(default=1.0, gt=0)
    name: str | None = Field(
        default=None,
        min_length=1,
        # It is a path segment of /admin/engines/{id}/... (a '/', '?', '#' or '%' could not be
        # addressed) and the value of every answer's x-slogate-engine header (a control character
        # there made uvicorn drop each connection after the engine had done the work): visible
        # ASCII only, without those four
        pattern=r"^[!\x22\x24\x26-\x2e\x30-\x3e\x40-\x7e]+$",
        description="engine id (visible ASCII, no '/', '?', '#' or '%'); default: host:port",
    )
    api_key: str | None = Field(default=None, description="sent upstream as a Bearer token", repr=False)
    api_key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable holding api_key, read when the settings load "
        "(from a Secret, so the key never sits in a config file or a ConfigMap)",
    )
    priority_scheduling: bool = Field(
        default=False, description="engine runs with priority scheduling and accepts the body 'priority'"
    )
    priority_low_first: bool | None = Field(
        default=None,
        description="the engine schedules lower 'priority' values first; default per kind: vLLM yes, "
        "SGLang no (unless launched with --schedule-low-priority-values-first)",
    )
    latency_profile: str | None = Field(
        default=None,
        description="profiles/engines/<name>.yaml: prior latency coefficients for the dispatcher",
    )
    time_scale: float = Field(
        default=1.0, gt=0, description="engine runs this many times faster than its profile"
    )
    kv_transfer: KvTransfer | None = Field(
        default=None,
        description="how a prefill engine hands KV to a decode engine: nixl (vLLM: the prefill runs "
        "first and its kv_transfer_params go to the decode), bootstrap (SGLang: bootstrap host, "
        "port and room in both bodies, sent together) or shared (a KV store both engines read by "
        "prefix, e.g. vLLM's ExampleConnector or LMCache: the prefill runs first, the decode gets "
        "the client's body); default per kind: sglang bootstrap, else nixl",
    )
    bootstrap_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="a bootstrap prefill engine's KV bootstrap port (SGLang "
        "--disaggregation-bootstrap-port, default 8998; the simulated engine: its HTTP port)",
    )

    kv_events_endpoint: str | None = Field(
        default=None,
        min_length=1,
        description="the engine's KV-cache event publisher as the gateway reaches it (vLLM "
        "--kv-events-config endpoint, e.g. tcp://engine:5557): feeds the prefix index exactly",
    )
    kv_events_topic: str = Field(default="", description="subscription prefix of the KV events ('' = all)")
    kv_events_replay_endpoint: str | None = Field(
        default=None, min_length=1, description="the engine's KV-event replay socket (vLLM replay_endpoint)"
    )
    kv_events_bind: bool = Field(
        default=False,
        description="the engine connects to the gateway (its endpoint names a host): the gateway binds",
    )

    @property
    def transfer_protocol(self) -> KvTransfer:
        if self.kv_transfer is not None:
            return self.kv_transfer
        return "bootstrap" if self.kind == "sglang" else "nixl"

    @property
    def kv_bootstrap_port(self) -> int:
        if self.bootstrap_port is not None:
            return self.bootstrap_port
        if self.kind == "sim":
            return self.url.port or 80
        return 8998

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def engine_id(self) -> str:
        if self.name:
            return self.name
        return f"{self.url.host}:{self.url.port}"

    @field_validator("url")
    @classmethod
    def _base_url(cls, url: HttpUrl) -> HttpUrl:
        # the OpenAI convention gives a base URL ending in /v1, but the gateway adds the routes'
        # own /v1/...: such an engine answered every check 404 and was never healthy, unexplained
        path = (url.path or "").rstrip("/")
        if path == "/v1" or path.endswith("/v1"):
            raise ValueError(
                f"give the engine's server address without the API path: "
                f"{str(url).rstrip('/').removesuffix('/v1')} (the gateway adds /v1/... itself)"
            )
        return url

    @model_validator(mode="after")
    def _kv_event_endpoints(self) -> EngineConfig:
        # checked here: a ZMQ socket refuses a bad address only when the subscriber starts, and
        # it then retried and logged forever while the prefix index heard nothing
        if self.kv_events_endpoint is not None:
            _check_zmq_endpoint("kv_events_endpoint", self.kv_events_endpoint, self.kv_events_bind)
        if self.kv_events_replay_endpoint is not None:
            _check_zmq_endpoint("kv_events_replay_endpoint", self.kv_events_replay_endpoint, False)
        return self

    @model_validator(mode="after")
    def _key_from_env(self) -> EngineConfig:
        # before _one_credential (validators run in order), which must see a key from here too
        if self.api_key_env is None:
            return self
        if self.api_key is not None:
            raise ValueError("give the engine's key either as api_key or as api_key_env, not both")
        # a Secret made from a file often ends with a newline, which no Bearer header can carry
        value = os.environ.get(self.api_key_env, "").strip()
        if not value:
            raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is not set or empty")
        self.api_key = _check_key(value, f"api_key_env {self.api_key_env}")
        return self

    @model_validator(mode="after")
    def _one_credential(self) -> EngineConfig:
        # aiohttp refuses a request with both (every health check would fail, silently)
        if self.api_key and (self.url.username or self.url.password):
            raise ValueError("give the engine's credentials either as api_key or in the URL, not both")
        return self


class Settings(BaseSettings):
    """Everything the gateway process needs; validated before anything starts."""

    model_config = SettingsConfigDict(
        env_prefix="SLOGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        # str(ValidationError) would otherwise quote the offending value, which may be a key
        hide_input_in_errors=True,
        # no setting means "no limit" by inf: an infinite timeout passed here and then overflowed
        # in aiohttp on every request (NaN compares false against every bound)
        allow_inf_nan=False,
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="the Host names (no port) it answers a browser on besides localhost, "
        "*.localhost, 127.0.0.1 and ::1: checked when it listens on a loopback address or this lists "
        "any; '*' answers any (a web page that rebinds its own name to 127.0.0.1 reaches a local "
        "gateway as same-origin otherwise). Requests no browser sent are never checked",
    )
    api_keys: list[str] = Field(default_factory=list, description="accepted client keys; empty = no auth")
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="keys for /admin/* (and /metrics unless metrics_public); client keys are not admin keys",
    )
    metrics_public: bool = Field(default=False, description="/metrics needs no key even when keys are set")
    api_key_policies: dict[str, ApiKeyPolicy] = Field(
        default_factory=dict,
        description="client key -> tenant, task and SLO ceilings; every key named here is accepted",
    )
    forward_sim_headers: bool = Field(
        default=False, description="relay the client's x-sim-* headers to simulated engines (sim only)"
    )
    engines: list[EngineConfig] = Field(default_factory=list)
    profiles_dir: Path = DEFAULT_PROFILES_DIR
    routing_profile: str = Field(default="least-load", description="name in profiles/routing or a path")
    slo_profile: str = Field(default="hyperflexis-4task", description="name in profiles/slo or a path")
    api_key_tasks: dict[str, str] = Field(
        default_factory=dict, description="API key -> default task (SLO class)"
    )
    api_key_tenants: dict[str, str] = Field(default_factory=dict, description="API key -> tenant")
    max_engine_load: int | None = Field(
        default=None, ge=1, description="requests one engine may hold; the rest queue in the gateway"
    )

    monitor_interval_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=3.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    scrape_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="per metrics scrape; a slow or failed scrape makes the state stale, never ejects",
    )
    eject_after_failures: int = Field(default=2, ge=1)
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        allow_inf_nan=False,
        description="on SIGTERM (or Ctrl-C) the gateway stops accepting and open requests get this "
        "long to finish; then each open stream ends with an in-band error event (code "
        "shutting_down) and [DONE], each request not yet answered gets a 503 with Retry-After, "
        "and their engine requests are aborted. Keep it below the time the platform waits before "
        "it kills the process (Kubernetes' terminationGracePeriodSeconds less any preStop sleep: "
        "the Helm chart sets it so)",
    )
    stall_after_s: float = Field(
        default=15.0,
        ge=0,
        allow_inf_nan=False,
        description="an engine holding work that shows no progress (no first token, streamed event "
        "or work counter moving) for this long is taken out of rotation until it does or holds "
        "nothing, unless it is its model's last engine in rotation; 0 = off",
    )
    outlier_consecutive_failures: int = Field(
        default=5,
        ge=0,
        description="an engine whose requests fail this many times in a row (5xx answers, cut or "
        "stalled streams, timeouts) is taken out of rotation for outlier_ejection_s, doubled for "
        "each ejection in a row up to outlier_max_ejection_s; never more than "
        "outlier_max_ejected_percent of a pool, nor its last engine; 0 = off",
    )
    outlier_ejection_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    outlier_max_ejection_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    outlier_max_ejected_percent: float = Field(default=50.0, ge=0, le=100, allow_inf_nan=False)
    readmit_after_successes: int = Field(default=1, ge=1)

    latency_step_gap_s: float = Field(
        default=0.001,
        ge=0,
        allow_inf_nan=False,
        description="latency learning: streamed tokens of one engine less than this apart are one "
        "engine step",
    )
    calibration: bool = Field(
        default=False,
        description="probe each engine (a few prompts with max_tokens 1, a few short decodes) when it "
        "joins and when idle, to seed its latency model; never client traffic, never client capacity",
    )
    calibration_interval_s: float = Field(
        default=600.0, gt=0, allow_inf_nan=False, description="an idle engine is probed again after this"
    )

    upstream_pool_size: int = Field(default=2048, ge=1, description="max upstream connections in total")
    upstream_pool_per_host: int = Field(default=0, ge=0, description="0 = no per-engine limit")
    upstream_keepalive_s: float = Field(
        default=4.0,
        gt=0,
        lt=ENGINE_KEEPALIVE_S,
        allow_inf_nan=False,
        description="idle upstream connections are closed after this; keep it below the engines' own "
        "keep-alive (vLLM/uvicorn: 5 s) so the gateway never reuses a connection the engine is closing",
    )
    connect_timeout_s: float = Field(default=3.0, gt=0, description="opening a new upstream connection")
    pool_timeout_s: float = Field(
        default=10.0, gt=0, description="waiting for a pooled upstream connection (connect_timeout_s on top)"
    )
    headers_timeout_s: float = Field(
        default=60.0, gt=0, description="stream: from sending the request to the engine's response headers"
    )
    first_token_timeout_s: float = Field(
        default=600.0, gt=0, description="stream: from dispatch to the first streamed event"
    )
    idle_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="stream: max silence between events after the first, and max time a client may "
        "stop reading before its stream is ended and the engine request aborted",
    )
    request_timeout_s: float = Field(
        default=900.0, gt=0, description="non-stream: the whole request from arrival, every attempt included"
    )
    dispatch_attempts: int = Field(default=3, ge=1, description="engines tried before the first byte")
    migration_limit: int = Field(
        default=0,
        ge=0,
        description="decode migration: times one stream may be resumed on another engine after its "
        "engine failed mid-stream or (migration_slack) fell behind its TPOT; 0 = off. When on, "
        "eligible streams ask vLLM and simulated engines for token ids (return_token_ids)",
    )
    migration_slack: bool = Field(
        default=True, description="decode migration may also move a stream whose TPOT slack stays negative"
    )
    migration_slack_bound_s: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a stream's TPOT slack must stay negative before it may move",
    )
    migration_min_remaining_tokens: int = Field(
        default=16, ge=1, description="a slow stream with fewer output tokens left stays where it is"
    )
    migration_target_margin: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="a slack move's target must be predicted to decode within this share of the TPOT target",
    )

    max_head_bytes: int = Field(
        default=64 * 1024, ge=4096, description="a request line and headers longer than this get a 431"
    )
    head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request line and headers must arrive within this of their first byte",
    )
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_body_memory_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=64 * 1024,
        description="request bodies held at once (their bytes as they arrive, until their request "
        "ends) past this get a 503; bodies over 64 KiB may use three quarters of it",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="a request body must arrive whole within this (else 408)"
    )
    offload_parse_bytes: int = Field(
        default=1024 * 1024,
        ge=0,
        description="bodies larger than this are parsed in a worker process, off the event loop",
    )
    default_max_tokens: int = Field(default=1024, ge=1)
    prefix_index_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="memory budget of the prefix index (per-engine cached prompt blocks), used when "
        "the routing profile reads prefix matches; 0 = no index",
    )
    prefix_dispatch_ttl_s: float = Field(
        default=120.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a dispatched prompt counts as cached on its engine without a KV event",
    )
    engine_tokenizers: dict[str, Path] = Field(
        default_factory=dict,
        description="served model name -> directory of the model's Hugging Face tokenizer "
        "(tokenizer.json, tokenizer_config.json or chat_template.jinja): the prefix index keys that "
        "model's prompts with it, as vLLM tokenizes them, so the engines' KV events match; without "
        "an entry a model's prompts are keyed with the gateway's own tokenizer (the simulated "
        "engine's). Needs slogate[hf-tokenizer]",
    )
    affinity_ttl_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a session keeps its engine after its last request (session affinity)",
    )
    affinity_max_sessions: int = Field(
        default=100_000,
        ge=2,
        description="sessions the affinity store remembers: half for sessions seen once, half for "
        "those seen again (least recent forgotten first)",
    )

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_requests: bool = False
    tracing: bool = Field(default=False, description="OpenTelemetry spans for every data-path request")
    tracing_exporter: Literal["otlp", "console", "none"] = Field(
        default="otlp", description="where spans go; none: made and dropped (to measure tracing's cost)"
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP collector: http/protobuf takes the traces URL (http://collector:4318/v1/traces), "
        "grpc the collector's address (http://collector:4317); unset: the exporter's own default, "
        "which honours the standard OTEL_EXPORTER_OTLP_* environment variables",
    )
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    otlp_headers: dict[str, str] = Field(
        default_factory=dict, description="headers sent to the collector (its credentials: never printed)"
    )
    otlp_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    tracing_sample_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0, description="share of new traces kept; a client's sampled flag wins"
    )
    tracing_service_name: str = Field(default="slogate", min_length=1)

    state_store: Literal["memory", "redis"] = Field(
        default="memory",
        description="what gateway replicas share: memory (one replica; the default) or redis (several "
        "replicas count each other's requests on every engine, for routing and max_engine_load)",
    )
    redis_url: str | None = Field(
        default=None,
        description="the Redis server for state_store: redis (redis://[:password@]host:port/db, "
        "rediss:// for TLS, unix:///path.sock); never printed",
    )
    replica_id: str = Field(
        # (a random part too: containers on the host's network share its name, and each is pid 1)
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9._:@-]+$",
        description="this replica's name in the state store, its own (default: host name, process id "
        "and a random part; the Helm chart gives each pod its name)",
    )
    state_namespace: str = Field(
        default="slogate",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="what this deployment's keys and channels in the state store begin with: "
        "deployments sharing one Redis database need their own (the Helm chart gives each release "
        "its name), or they count each other's requests and take each other's sessions",
    )
    replica_sync_interval_s: float = Field(
        default=0.5,
        ge=0.01,
        le=10.0,
        description="how often a replica writes its in-flight counts and reads every other "
        "replica's in full (what the pushed changes missed; replicas gone)",
    )
    replica_push_delay_s: float = Field(
        default=0.002,
        ge=0.0,
        le=1.0,
        description="a replica's placements and completions are pushed to the others within this "
        "long, several in one message: two replicas may both take an engine's last seat within it "
        "(and a round trip to the store)",
    )
    state_store_timeout_s: float = Field(default=0.5, gt=0, le=30.0, description="per state store call")

    dashboard_public: bool = Field(
        default=False,
        description="/dashboard needs no key even when keys are set (as metrics_public); without an "
        "admin key it shows what /metrics does, not clients' request ids nor engines' errors",
    )
    dashboard_decisions: int = Field(
        default=200, ge=0, le=100_000, description="recent dispatch decisions /dashboard keeps (0: none)"
    )

    @field_validator("engines")
    @classmethod
    def _unique_engine_ids(cls, engines: list[EngineConfig]) -> list[EngineConfig]:
        seen: set[str] = set()
        for engine in engines:
            if engine.engine_id in seen:
                raise ValueError(
                    f"duplicate engine id {engine.engine_id!r}; give each engine a distinct name"
                )
            seen.add(engine.engine_id)
        served: set[tuple[str, str]] = set()
        for engine in engines:
            # one server may serve several models (a generic OpenAI server), but one model there
            # twice is one engine counted as two: its load read twice, its limit doubled
            key = (str(engine.url).rstrip("/"), engine.model)
            if key in served:
                raise ValueError(
                    f"engine {engine.engine_id!r} repeats {key[0]} for model {engine.model!r}: "
                    "one server, one entry per model it serves"
                )
            served.add(key)
        roles: dict[str, set[Role]] = {}
        for engine in engines:
            roles.setdefault(engine.model, set()).add(engine.role)
        for model, present in sorted(roles.items()):
            # a half of a P/D pair alone serves nothing: say which half is missing
            if Role.PREFILL in present and Role.DECODE not in present:
                raise ValueError(f"model {model!r} has prefill engines but no decode engine (role: decode)")
            if Role.DECODE in present and not present & {Role.PREFILL, Role.COLLOCATED}:
                raise ValueError(
                    f"model {model!r} has decode engines but no prefill engine: give one role: prefill, "
                    "or make them role: collocated"
                )
        return engines

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _valid_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            _check_key(key, "every key")
        return keys

    @field_validator("api_key_policies", "api_key_tasks", "api_key_tenants", mode="wrap")
    @classmethod
    def _valid_mapped_keys(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # These mappings are keyed by API keys, and pydantic names a bad entry by its key (in
        # str(exc) too, which hide_input_in_errors does not cover): re-raise with fingerprints.
        try:
            mapping = handler(value)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(key_fingerprint(str(p)) if i == 0 else str(p) for i, p in enumerate(err["loc"]))
            raise ValueError(f"{loc}: {err['msg']}" if loc else str(err["msg"])) from None
        for key in mapping:
            _check_key(key, "every key")
        return mapping

    @model_validator(mode="after")
    def _keys_are_consistent(self) -> Settings:
        admin = set(self.admin_api_keys)
        for key in [*self.api_keys, *self.api_key_policies]:
            if key in admin:
                raise ValueError(
                    f"{key_fingerprint(key)} is both a client and an admin key; give admins their own key"
                )
        for key, policy in self.api_key_policies.items():
            task, tenant = self.api_key_tasks.get(key), self.api_key_tenants.get(key)
            if task is not None and policy.task is not None and task != policy.task:
                raise ValueError(
                    f"api_key_tasks and api_key_policies disagree on the task of {key_fingerprint(key)}"
                )
            if tenant is not None and policy.tenant is not None and tenant != policy.tenant:
                raise ValueError(
                    f"api_key_tenants and api_key_policies disagree on the tenant of {key_fingerprint(key)}"
                )
        return self

    @model_validator(mode="after")
    def _one_body_fits_the_budget(self) -> Settings:
        from gateway.api.body_budget import SMALL_BODY_BYTES, large_share

        largest, budget = self.max_body_bytes, self.max_body_memory_bytes
        cap = budget if largest <= SMALL_BODY_BYTES else large_share(budget)
        if cap < largest:
            raise ValueError(
                f"max_body_memory_bytes ({budget}) must hold one body of "
                f"max_body_bytes ({largest}): bodies over 64 KiB may use three quarters of it; "
                f"raise it to at least {-(-largest * 4 // 3)}"
            )
        return self

    @model_validator(mode="after")
    def _exporter_installed(self) -> Settings:
        from gateway.tracing import otlp_available

        if self.tracing and self.tracing_exporter == "otlp" and not otlp_available(self.otlp_protocol):
            raise ValueError(
                f"tracing_exporter: the OTLP {self.otlp_protocol} exporter is not installed; "
                "pip install 'slogate[otlp]' (or set tracing_exporter: console)"
            )
        return self

    @model_validator(mode="after")
    def _outlier_times_ordered(self) -> Settings:
        if self.outlier_ejection_s > self.outlier_max_ejection_s:
            raise ValueError("outlier_ejection_s must not exceed outlier_max_ejection_s")
        return self

    def outlier_params(self) -> OutlierParams:
        return OutlierParams(
            self.outlier_consecutive_failures,
            self.outlier_ejection_s,
            self.outlier_max_ejection_s,
            self.outlier_max_ejected_percent / 100.0,
        )

    @model_validator(mode="after")
    def _store_reachable_by_url(self) -> Settings:
        if self.state_store == "redis":
            if not self.redis_url:
                raise ValueError("redis_url: state_store: redis needs the server's URL (redis://host:6379/0)")
            if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError("redis_url: must start with redis://, rediss:// or unix://")
            try:
                parts = urlsplit(self.redis_url)
                _ = parts.port  # (a port that is not a number raises here, not at start-up)
            except ValueError:
                raise ValueError("redis_url: not a URL of a server (host, port, database)") from None
            if not (parts.hostname or parts.path):
                raise ValueError("redis_url: names no server")
            _check_redis_url(self.redis_url)
        return self

    @model_validator(mode="after")
    def _engine_tokenizers_load(self) -> Settings:
        if not self.engine_tokenizers:
            return self
        from gateway.fleet.engine_tokenizer import INSTALL_HINT, directory_problem, missing_packages

        missing = missing_packages()
        if missing:
            raise ValueError(f"engine_tokenizers: {', '.join(missing)} not installed; {INSTALL_HINT}")
        for model, directory in self.engine_tokenizers.items():
            problem = directory_problem(directory)
            if problem is not None:
                raise ValueError(f"engine_tokenizers.{model}: {problem}")
        return self

    @model_validator(mode="after")
    def _profiles_exist(self) -> Settings:
        self.routing_profile_path()
        self.slo_profile_path()
        for engine in self.engines:
            if engine.latency_profile is not None:
                self.profile_path("engines", engine.latency_profile)
        return self

    def profile_path(self, kind: str, name: str) -> Path:
        """``profiles/<kind>/<name>.yaml``, or ``name`` itself when it is a YAML path."""
        candidate = Path(name)
        path = (
            candidate if candidate.suffix in (".yaml", ".yml") else self.profiles_dir / kind / f"{name}.yaml"
        )
        if not path.is_file():
            known = sorted(p.stem for p in (self.profiles_dir / kind).glob("*.yaml"))
            raise ValueError(f"{kind} profile {name!r} not found; known: {known}")
        return path

    def routing_profile_path(self) -> Path:
        return self.profile_path("routing", self.routing_profile)

    def client_keys(self) -> frozenset[str]:
        """Keys accepted on the data path: ``api_keys`` plus every key that has a policy.

        A policy's ceilings only mean something if the key is enforced (a client could otherwise
        just leave the key out), so naming a key in ``api_key_policies`` turns authentication on.
        """
        return frozenset(self.api_keys) | frozenset(self.api_key_policies)

    def key_policies(self) -> dict[str, ApiKeyPolicy]:
        """Every key's effective policy, with the older ``api_key_tasks``/``api_key_tenants`` folded in.

        Keys only in the older mappings keep their old meaning: a default task that ``x-slo-task``
        may override, no ceilings.
        """
        out: dict[str, ApiKeyPolicy] = {}
        for key in {*self.api_key_tasks, *self.api_key_tenants}:
            out[key] = ApiKeyPolicy(
                task=self.api_key_tasks.get(key), tenant=self.api_key_tenants.get(key), task_override=True
            )
        for key, policy in self.api_key_policies.items():
            legacy = out.get(key)
            if legacy is not None:
                policy = policy.model_copy(
                    update={"task": policy.task or legacy.task, "tenant": policy.tenant or legacy.tenant}
                )
            out[key] = policy
        return out

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # Keys never reach a repr (and so never a log line or a traceback's locals).
        for name, value in super().__repr_args__():
            if name in SECRET_FIELDS and value is not None:
                yield name, f"<{len(value)} redacted>"
            else:
                yield name, value

    def slo_profile_path(self) -> Path:
        return self.profile_path("slo", self.slo_profile)


def _read_yaml(config_file: Path | None) -> dict[str, Any]:
    if config_file is None:
        return {}
    data = yaml.safe_load(config_file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{config_file}: the top level must be a mapping of settings")
    for key in data:
        if not isinstance(key, str):
            # (YAML reads yes, on, null and 8000 as other things than names: a traceback followed)
            raise ValueError(f"{config_file}: {key!r} is not a setting's name (quote it if it is one)")
    return data


#: mappings whose keys are case-sensitive (API keys, model names)
_CASED_MAPPINGS = ("api_key_policies", "api_key_tasks", "api_key_tenants", "engine_tokenizers")


def _refuse_lowercased_keys() -> None:
    """Environment variables name settings case-insensitively, so a nested one
    (``SLOGATE_API_KEY_POLICIES__<key>__max_priority``) reached the settings with its key
    lowercased: an API key given that way never matched. Refused, naming the setting only (the
    variable's name holds the key itself)."""
    for name in os.environ:
        upper = name.upper()
        for field in _CASED_MAPPINGS:
            if upper.startswith(f"SLOGATE_{field.upper()}__"):
                raise ValueError(
                    f"{field}: a nested SLOGATE_{field.upper()}__... variable loses the case of the key "
                    f"it names; give the whole mapping as JSON in SLOGATE_{field.upper()}"
                )


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from overrides, the environment and an optional YAML file (lowest priority)."""
    _refuse_lowercased_keys()
    file_values = _read_yaml(config_file)
    environment = {name.upper() for name in os.environ}
    for key in sorted(file_values):
        if f"SLOGATE_{key.upper()}" in environment and key not in overrides:
            # (an image's SLOGATE_HOST / SLOGATE_PORT silently beat a mounted file's host and port)
            _log.warning(
                "%s in %s is not used: the environment's SLOGATE_%s is", key, config_file, key.upper()
            )

    class _WithFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, file_values))

    return _WithFile(**overrides)


def _is_secret(loc: tuple[int | str, ...]) -> bool:
    if not loc:
        return False
    return loc[0] in SECRET_FIELDS or (loc[0] == "engines" and "api_key" in loc)


def _safe_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` with any API key in it replaced (the keys of the key-keyed mappings are keys)."""
    if loc and loc[0] in SECRET_FIELDS and len(loc) > 1 and isinstance(loc[1], str):
        return (loc[0], key_fingerprint(loc[1]), *loc[2:])
    return loc


def describe_error(exc: ValidationError | ValueError | OSError | yaml.YAMLError) -> str:
    """One line saying which key is wrong and why (first error only); API keys and the passwords
    of URLs are never shown."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in _safe_loc(loc)) or "settings"
        shown = "input" in err and isinstance(err["input"], str | int | float | bool | None)
        given = (
            _without_userinfo(err["input"]) if shown and isinstance(err["input"], str) else err.get("input")
        )
        value = f" (got {given!r})" if shown and not _is_secret(loc) else ""
        more = f" [+{exc.error_count() - 1} more]" if exc.error_count() > 1 else ""
        return without_credentials(f"{key}: {err['msg']}{value}{more}")
    return without_credentials(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__


#: SLOGATE_* variables that are not gateway settings: the real-engine tier's, docker compose's
OTHER_VARIABLES = frozenset({"SLOGATE_CACHE_DIR", "SLOGATE_REAL_ENGINES", "SLOGATE_BIND"})
#: prefixes of SLOGATE_* variables an engine's ``api_key_env`` names (the Helm chart's, tests')
OTHER_PREFIXES = ("SLOGATE_ENGINE_API_KEY_", "SLOGATE_TEST_")
#: what Kubernetes puts in every pod for each Service (named slogate-... here) unless the pod
#: turns service links off: SLOGATE_X_SERVICE_HOST, SLOGATE_X_SERVICE_PORT[_NAME],
#: SLOGATE_X_PORT_8000_TCP[_PROTO|_PORT|_ADDR], and SLOGATE_X_PORT=tcp://... (by its value: a
#: misspelt SLOGATE_METRICS_PORT=9090 is no link)
_SERVICE_LINK = re.compile(
    r"SLOGATE(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)"
)
_LINK_PORT = re.compile(r"SLOGATE_[A-Z0-9_]+_PORT")
_LINK_ADDRESS = re.compile(r"(tcp|udp|sctp)://\S+")


def unknown_variable(
    environ: Mapping[str, str], settings: Settings, also_named: Collection[str] = ()
) -> str | None:
    """The first ``SLOGATE_*`` variable that names no setting, with the setting it may mean. The
    file refuses unknown keys, but the environment's were ignored without a word: a misspelt
    ``SLOGATE_API_KEY`` left the gateway open to all. ``also_named``: variables the caller knows
    to be someone's (``slogate up``: the keys of the engines it replaced)."""
    fields = {name.upper() for name in Settings.model_fields}
    named = {engine.api_key_env for engine in settings.engines if engine.api_key_env} | set(also_named)
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("SLOGATE_") or upper in OTHER_VARIABLES or name in named:
            continue
        if upper.startswith(OTHER_PREFIXES) or upper[8:].split("__", 1)[0] in fields:
            continue
        if _SERVICE_LINK.fullmatch(upper) or (
            _LINK_PORT.fullmatch(upper) and _LINK_ADDRESS.fullmatch(environ[name])
        ):
            continue
        close = difflib.get_close_matches(upper[8:], sorted(fields), n=1)
        hint = f" (did you mean SLOGATE_{close[0]}?)" if close else ""
        return f"{name} names no setting{hint}"
    return None


def load_settings_or_exit(
    config_file: Path | None = None, *, also_named: Collection[str] = (), **overrides: Any
) -> Settings:
    """CLI helper: on a bad value, or a ``SLOGATE_*`` variable that names no setting (nor one of
    ``also_named``), print one line to stderr and exit with status 2."""
    try:
        settings = load_settings(config_file, **overrides)
    except (ValidationError, ValueError, OSError, yaml.YAMLError) as exc:
        print(f"slogate: invalid configuration: {describe_error(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    unknown = unknown_variable(os.environ, settings, also_named)
    if unknown is not None:
        print(f"slogate: invalid configuration: {unknown}", file=sys.stderr)
        raise SystemExit(2)
    return settings


_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):(\d{1,5})")


def _check_zmq_endpoint(field: str, endpoint: str, bind: bool) -> None:
    """A ZMQ address the gateway can connect to (or, with ``bind``, bind): ``tcp://host:port`` or
    ``ipc://path``."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://") and not endpoint[6:].isspace():
        return
    match = _TCP_ENDPOINT.fullmatch(endpoint)
    if match is None:
        raise ValueError(f"{field}: give tcp://host:port or ipc://path, got {endpoint[:200]!r}")
    host, port = match.group(1), int(match.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"{field}: port {port} is not in 1-65535")
    if host == "*" and not bind:
        raise ValueError(
            f"{field}: * is the address an engine binds; give the host the gateway reaches it "
            "at (or set kv_events_bind: the gateway binds and the engine connects)"
        )


def _check_redis_url(url: str) -> None:
    """What the Redis client makes of ``url``, checked now: a query parameter it does not take
    failed every store call (a traceback every round, the replicas never sharing), and a database
    that is not a number was dropped for database 0 without a word."""
    parts = urlsplit(url)
    if parts.scheme != "unix":
        # (as the client reads it: unquoted, its slashes dropped; "/0/" and "/%31" are databases)
        database = unquote(parts.path).replace("/", "")
        if database and not database.isdigit():
            raise ValueError(f"redis_url: the database must be a number, not {database[:20]!r}")
    try:
        import redis.asyncio as aioredis
    except ImportError:  # (the client comes with the package: nothing to check against)
        return
    try:
        aioredis.ConnectionPool.from_url(url).make_connection()  # type: ignore[no-untyped-call]
    except Exception as exc:  # (TypeError, ValueError, the client's own RedisError: any refusal)
        raise ValueError(f"redis_url: the Redis client refuses it ({exc})") from None


def settings_warnings(settings: Settings) -> list[str]:
    """Settings that are valid each alone but defeat each other (logged at start-up)."""
    warnings: list[str] = []
    if settings.stale_after_s <= settings.monitor_interval_s:
        warnings.append(
            f"stale_after_s ({settings.stale_after_s:g}) is not above monitor_interval_s "
            f"({settings.monitor_interval_s:g}): each engine's scraped state goes stale before the next "
            "scrape, and routing reads only the gateway's own counts"
        )
    return warnings
