"""The dispatch core the settings describe: one construction for the live gateway and the simulator.

Both drivers (the asyncio :class:`~gateway.dispatch.loop.DispatchLoop` and the virtual-time
cluster simulator) build their core here, so a routing profile, an SLO profile and the engine
settings mean the same decisions in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.dispatch.core import DispatchCore
from gateway.dispatch.profile import DispatcherConfig, dispatcher_config
from gateway.dispatch.slo_service import SloService
from gateway.fleet.registry import Fleet
from gateway.router import Router, load_pipeline
from gateway.settings import Settings
from policies.pipeline import RoutingPipeline


@dataclass(frozen=True, slots=True)
class RoutingProfile:
    """A routing profile file, compiled: the pipeline and the dispatcher part."""

    pipeline: RoutingPipeline
    dispatcher: DispatcherConfig

    @classmethod
    def load(cls, path: Path) -> RoutingProfile:
        """Read and validate ``path``; raises PolicyConfigError/ValueError naming the file."""
        return cls(load_pipeline(path), dispatcher_config(yaml.safe_load(path.read_text())))


def build_core(settings: Settings, fleet: Fleet, slo: SloService, routing: RoutingProfile) -> DispatchCore:
    return DispatchCore(
        fleet,
        Router(fleet, routing.pipeline),
        routing.dispatcher.order,
        slo.coefficients,
        slo.class_limits,
        hyperflexis=routing.dispatcher.hyperflexis,
        max_engine_load=settings.max_engine_load,
        tightest_ttft_s=slo.profile.tightest_ttft_s,
    )
