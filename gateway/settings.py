"""Gateway settings: one pydantic-settings object, built once at start-up and passed down.

Sources, highest priority first: keyword arguments, environment variables (prefix ``SLOGATE_``,
nested keys joined with ``__``; lists and objects as JSON), then the YAML file given with
``--config``. Nothing reads the environment at import time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from policies.api import Role
from profiles import PROFILES_DIR as DEFAULT_PROFILES_DIR

EngineKind = Literal["vllm", "sglang", "sim", "openai", "llamacpp"]


class EngineConfig(BaseModel):
    """One upstream engine as a user declares it."""

    model_config = ConfigDict(extra="forbid")

    url: HttpUrl
    kind: EngineKind = "vllm"
    model: str = Field(min_length=1, description="served model name clients ask for")
    role: Role = Role.COLLOCATED
    weight: float = Field(default=1.0, gt=0)
    name: str | None = Field(default=None, description="engine id; default: host:port")
    api_key: str | None = Field(default=None, description="sent upstream as a Bearer token")
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

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def engine_id(self) -> str:
        if self.name:
            return self.name
        return f"{self.url.host}:{self.url.port}"


class Settings(BaseSettings):
    """Everything the gateway process needs; validated before anything starts."""

    model_config = SettingsConfigDict(
        env_prefix="SLOGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="accepted client keys; empty = no auth")
    engines: list[EngineConfig] = Field(default_factory=list)
    profiles_dir: Path = DEFAULT_PROFILES_DIR
    routing_profile: str = Field(default="least-load", description="name in profiles/routing or a path")
    slo_profile: str = Field(default="hyperflexis-4task", description="name in profiles/slo or a path")
    api_key_tasks: dict[str, str] = Field(
        default_factory=dict, description="API key -> default task (SLO class)"
    )
    api_key_tenants: dict[str, str] = Field(default_factory=dict, description="API key -> tenant")
    max_engine_load: int | None = Field(
        default=None, ge=1, description="pipeline dispatcher: queue when every engine has this many requests"
    )

    monitor_interval_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=3.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    eject_after_failures: int = Field(default=2, ge=1)
    readmit_after_successes: int = Field(default=1, ge=1)

    upstream_pool_size: int = Field(default=2048, ge=1, description="max upstream connections in total")
    upstream_pool_per_host: int = Field(default=0, ge=0, description="0 = no per-engine limit")
    connect_timeout_s: float = Field(default=3.0, gt=0)
    first_token_timeout_s: float = Field(default=600.0, gt=0)
    idle_timeout_s: float = Field(default=120.0, gt=0, description="max silence between streamed chunks")
    request_timeout_s: float = Field(default=900.0, gt=0, description="whole non-streaming request")
    dispatch_attempts: int = Field(default=3, ge=1, description="engines tried before the first byte")

    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    default_max_tokens: int = Field(default=1024, ge=1)

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_requests: bool = False
    tracing: bool = Field(default=False, description="OpenTelemetry spans (console or OTLP exporter)")
    otlp_endpoint: str | None = None

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
        return engines

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

    def slo_profile_path(self) -> Path:
        return self.profile_path("slo", self.slo_profile)


def _read_yaml(config_file: Path | None) -> dict[str, Any]:
    if config_file is None:
        return {}
    data = yaml.safe_load(config_file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{config_file}: the top level must be a mapping of settings")
    return data


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from overrides, the environment and an optional YAML file (lowest priority)."""
    file_values = _read_yaml(config_file)

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


def describe_error(exc: ValidationError | ValueError | OSError | yaml.YAMLError) -> str:
    """One line saying which key is wrong and why (first error only)."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "settings"
        value = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        more = f" [+{exc.error_count() - 1} more]" if exc.error_count() > 1 else ""
        return f"{key}: {err['msg']}{value}{more}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def load_settings_or_exit(config_file: Path | None = None, **overrides: Any) -> Settings:
    """CLI helper: on a bad value print one line to stderr and exit with status 2."""
    try:
        return load_settings(config_file, **overrides)
    except (ValidationError, ValueError, OSError, yaml.YAMLError) as exc:
        print(f"slogate: invalid configuration: {describe_error(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
