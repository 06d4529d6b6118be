"""A dispatch core over engines that are never contacted: for benchmarks, tests and simulators.

The fleet's adapters get no HTTP session (nothing here does I/O); health and scraped state are set
directly on the registry, exactly as the monitor would set them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import aiohttp

from gateway.dispatch.core import ClassLimits, DispatchCore
from gateway.engines import adapter_for
from gateway.fleet.registry import Fleet
from gateway.router import Router
from gateway.settings import EngineConfig
from policies.flow_control import SheddingParams
from policies.hyperflexis import HyperFlexisParams
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL, Coeffs
from policies.pipeline import compile_profile
from policies.queue_order import make_order


def offline_fleet(engines_per_model: dict[str, int], stale_after_s: float = 3.0) -> Fleet:
    """Healthy engines named ``<model>-<i>``, ports made up, never contacted."""
    configs = [
        EngineConfig(url=f"http://127.0.0.1:{10_000 + i}", kind="sim", model=model, name=f"{model}-{i}")  # type: ignore[arg-type]
        for model, count in engines_per_model.items()
        for i in range(count)
    ]
    return fleet_of(configs, stale_after_s)


def fleet_of(configs: Sequence[EngineConfig], stale_after_s: float) -> Fleet:
    """A fleet of these engines, all healthy, with adapters that have no HTTP session."""
    no_session = cast(aiohttp.ClientSession, None)
    fleet = Fleet([adapter_for(c, no_session, 1.0) for c in configs], stale_after_s)
    for engine_id in fleet.records:
        fleet.record_health(engine_id, True, 1, 1)
    return fleet


def offline_core(
    fleet: Fleet,
    dispatcher: str = "pipeline",
    order: str = "fcfs",
    scorers: Sequence[str] = ("least_load",),
    max_engine_load: int | None = None,
    limits: ClassLimits | None = None,
    hyperflexis: HyperFlexisParams | None = None,
    coefficients: tuple[Coeffs, Coeffs] = (DEFAULT_PREFILL, DEFAULT_DECODE),
    tightest_ttft_s: float = math.inf,
    shedding: SheddingParams | None = None,
) -> DispatchCore:
    """A :class:`DispatchCore` with a routing pipeline of ``scorers`` and one latency model."""
    pipeline = compile_profile({"scorers": [{"name": s} for s in scorers]})
    return DispatchCore(
        fleet,
        Router(fleet, pipeline),
        make_order(order, {}),
        lambda _: coefficients,
        lambda _: limits or ClassLimits(),
        hyperflexis=(hyperflexis or HyperFlexisParams()) if dispatcher == "hyperflexis" else None,
        max_engine_load=max_engine_load,
        tightest_ttft_s=tightest_ttft_s,
        shedding=shedding,
    )
