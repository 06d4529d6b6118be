"""Engine profiles (``profiles/engines/*.yaml``): latency coefficients, KV capacity, bandwidths.

Validated with pydantic at load; a bad file raises :class:`ProfileError` naming the file and key.
The gateway's dispatcher reads the same files for its prior latency coefficients.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.latency import LatencyCoefficients
from profiles import PROFILES_DIR as DEFAULT_PROFILES_DIR

_STRICT = ConfigDict(extra="forbid", frozen=True)


class ProfileError(ValueError):
    pass


class Latency(BaseModel):
    """HyperFlexis eq.(1) prefill (a, b, c) and eq.(2) decode (a', b', c') coefficients, seconds."""

    model_config = _STRICT
    prefill_a: float = Field(ge=0)
    prefill_b: float = Field(ge=0)
    prefill_c: float = Field(ge=0)
    decode_a: float = Field(ge=0)
    decode_b: float = Field(ge=0)
    decode_c: float = Field(ge=0)

    @property
    def prefill(self) -> tuple[float, float, float]:
        return (self.prefill_a, self.prefill_b, self.prefill_c)

    @property
    def decode(self) -> tuple[float, float, float]:
        return (self.decode_a, self.decode_b, self.decode_c)

    @property
    def coefficients(self) -> LatencyCoefficients:
        """The same numbers as the pure step-time model's value type."""
        return LatencyCoefficients(
            self.prefill_a, self.prefill_b, self.prefill_c, self.decode_a, self.decode_b, self.decode_c
        )


class Transfer(BaseModel):
    model_config = _STRICT
    link_bandwidth_gbps: float = Field(gt=0, description="GB/s between prefill and decode engines")
    link_latency_s: float = Field(ge=0)


class Weights(BaseModel):
    model_config = _STRICT
    size_gb: float = Field(ge=0)
    load_overhead_s: float = Field(ge=0)
    disk_gbps: float = Field(gt=0)
    cpu_gbps: float = Field(gt=0)
    peer_gbps: float = Field(gt=0)
    #: a cold start's process and device runtime start before any weight loads (an engine of the
    #: warm pool has done it already; HyperFlexis §6 "Fast Scaling")
    runtime_start_s: float = Field(default=0.0, ge=0)

    def load_time_s(self, source: str) -> float:
        bandwidth = {"disk": self.disk_gbps, "cpu": self.cpu_gbps, "peer": self.peer_gbps}[source]
        return self.load_overhead_s + self.size_gb / bandwidth

    def cold_start_s(self) -> float:
        """A cold engine's way to serving: the runtime, then the weights from disk."""
        return self.runtime_start_s + self.load_time_s("disk")


class EngineProfile(BaseModel):
    model_config = _STRICT
    name: str
    model: str
    max_model_len: int = Field(ge=16)
    block_size: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=0)
    num_gpu_blocks: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    chunked_prefill: bool = True
    #: length of the vectors /v1/embeddings returns (384: a small sentence-embedding model's size)
    embedding_dim: int = Field(default=384, ge=1)
    latency: Latency
    transfer: Transfer
    weights: Weights

    def transfer_time_s(self, tokens: int) -> float:
        """Time to move ``tokens`` tokens of KV from a prefill engine to a decode engine."""
        gigabytes = tokens * self.kv_bytes_per_token / 1e9
        return self.transfer.link_latency_s + gigabytes / self.transfer.link_bandwidth_gbps


def profile_path(name: str, profiles_dir: Path = DEFAULT_PROFILES_DIR) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        return path
    return profiles_dir / "engines" / f"{name}.yaml"


def load_profile(name: str, profiles_dir: Path = DEFAULT_PROFILES_DIR) -> EngineProfile:
    """Load and validate an engine profile by name (``profiles/engines/<name>.yaml``) or path."""
    path = profile_path(name, profiles_dir)
    if not path.is_file():
        known = sorted(p.stem for p in (profiles_dir / "engines").glob("*.yaml"))
        raise ProfileError(f"engine profile {name!r} not found ({path}); known: {known}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None  # (one line)
    try:
        return EngineProfile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ProfileError(f"{path}: {key}: {err['msg']}") from None
