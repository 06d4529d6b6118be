"""Shared helpers for the simulated-engine tests: profiles and a virtual-time driver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gateway.sim.engine import EngineModel, SimRequest
from gateway.sim.profiles import EngineProfile, Latency, load_profile

MODEL = "sim-test"


def profile(**overrides: Any) -> EngineProfile:
    """The qwen-7b profile with overrides; ``latency=dict(...)`` replaces latency fields."""
    base = load_profile("qwen-7b")
    latency = overrides.pop("latency", None)
    if latency is not None:
        overrides["latency"] = Latency(**{**base.latency.model_dump(), **latency})
    return base.model_copy(update=overrides)


def write_profile(path: Path, **overrides: Any) -> Path:
    """Write a YAML profile (qwen-7b plus overrides) to ``path`` and return it."""
    data = load_profile("qwen-7b").model_dump()
    for key, value in overrides.items():
        if isinstance(value, dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    data["name"] = path.stem
    path.write_text(yaml.safe_dump(data))
    return path


def run_virtual(model: EngineModel, until: float = 1e9, start: float = 0.0) -> float:
    """Drive ``model`` in virtual time (from ``start``) until it has no runnable work; returns
    the end time."""
    now = start
    while model.has_work and now < until:
        batch = model.plan(now)
        if batch is None:
            nxt = model.next_transfer_at()
            if nxt == float("inf"):
                break
            now = max(now, nxt)
            continue
        now += batch.duration
        model.finish(batch, now)
    return now


def request(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0, **kw: Any) -> SimRequest:
    return SimRequest(rid, list(prompt), max_tokens, arrival, **kw)
