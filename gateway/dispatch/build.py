"""The dispatch core the settings describe: one construction for the live gateway and the simulator.

Both drivers (the asyncio :class:`~gateway.dispatch.loop.DispatchLoop` and the virtual-time
cluster simulator) build their core here, so a routing profile, an SLO profile and the engine
settings mean the same decisions in both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.dispatch.core import DispatchCore
from gateway.dispatch.profile import DispatcherConfig, dispatcher_config
from gateway.dispatch.slo_service import SloService
from gateway.fleet.kv_events import KVEventFeed, KVEventSource
from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.fleet.registry import Fleet
from gateway.router import Router, load_pipeline
from gateway.settings import Settings
from policies.api import PolicyConfigError
from policies.pipeline import RoutingPipeline
from policies.plugins.affinity import MemoryAffinityStore

#: routing plugins that read ``RequestView.prefix`` (the prefix index's matches)
PREFIX_PLUGINS = frozenset({"prefix_match", "dynamo_cost", "sglang_cache_aware"})
#: routing plugins that read ``RequestView.affinity`` (the affinity store's engine)
AFFINITY_PLUGINS = frozenset({"session_affinity", "gimbal"})

log = logging.getLogger("slogate.dispatch")


@dataclass(frozen=True, slots=True)
class RoutingProfile:
    """A routing profile file, compiled: the pipeline and the dispatcher part."""

    pipeline: RoutingPipeline
    dispatcher: DispatcherConfig

    @classmethod
    def load(cls, path: Path) -> RoutingProfile:
        """Read and validate ``path``; raises PolicyConfigError naming the file."""
        pipeline = load_pipeline(path)
        try:
            dispatcher = dispatcher_config(yaml.safe_load(path.read_text()))
        except ValueError as exc:
            raise PolicyConfigError(f"{path}: {exc}") from None
        return cls(pipeline, dispatcher)

    def plugin_names(self) -> frozenset[str]:
        names = {name for name, _ in self.pipeline.filters}
        names.update(s.name for s in self.pipeline.scorers)
        names.add(self.pipeline.picker_name)
        return frozenset(names)

    @property
    def reads_prefix(self) -> bool:
        """The profile scores prefix matches (its pipeline, or HyperFlexis preferring the worker
        holding most of a request's prompt)."""
        hyperflexis = self.dispatcher.hyperflexis
        prefers = hyperflexis is not None and hyperflexis.prefix_preference
        return prefers or bool(self.plugin_names() & PREFIX_PLUGINS)

    @property
    def reads_affinity(self) -> bool:
        return bool(self.plugin_names() & AFFINITY_PLUGINS)


def build_prefix_routing(settings: Settings, fleet: Fleet, routing: RoutingProfile) -> PrefixRouting | None:
    """The prefix index and the affinity store the routing profile reads, from the settings
    (None when it reads neither, or ``prefix_index_bytes`` is 0 and it reads no affinity)."""
    index = None
    if routing.reads_prefix and settings.prefix_index_bytes > 0:
        index = PrefixIndex(settings.prefix_index_bytes, settings.prefix_dispatch_ttl_s)
    affinity = None
    if routing.reads_affinity:
        affinity = MemoryAffinityStore(settings.affinity_ttl_s, settings.affinity_max_sessions)
    if index is None and affinity is None:
        return None
    hyperflexis = routing.dispatcher.hyperflexis
    return PrefixRouting(fleet, index, affinity, hyperflexis is not None and hyperflexis.prefix_preference)


def kv_event_feed(settings: Settings, prefix: PrefixRouting | None) -> KVEventFeed | None:
    """Subscribers for the engines that publish KV events, feeding the prefix index (None
    without an index or without such engines)."""
    if prefix is None or prefix.index is None:
        return None
    sources = [
        KVEventSource(
            e.engine_id,
            e.kv_events_endpoint,
            e.kv_events_topic,
            e.kv_events_replay_endpoint,
            e.kv_events_bind,
        )
        for e in settings.engines
        if e.kv_events_endpoint is not None
    ]
    if not sources:
        return None
    records = prefix.fleet.records
    return KVEventFeed(
        prefix.index, sources, refused_at=lambda engine_id: records[engine_id].adapter.refused_at
    )


def build_core(
    settings: Settings,
    fleet: Fleet,
    slo: SloService,
    routing: RoutingProfile,
    prefix: PrefixRouting | None = None,
) -> DispatchCore:
    dispatcher = routing.dispatcher
    # the operator's setting wins; a profile that only makes sense with a gateway queue brings its own
    max_engine_load = (
        settings.max_engine_load if settings.max_engine_load is not None else dispatcher.max_engine_load
    )
    for warning in engine_scheduling_warnings(routing, fleet, max_engine_load):
        log.warning(warning)
    core = DispatchCore(
        fleet,
        Router(fleet, routing.pipeline, prefix, policy=Path(settings.routing_profile).stem),
        dispatcher.order,
        slo.coefficients,
        slo.class_limits,
        hyperflexis=dispatcher.hyperflexis,
        max_engine_load=max_engine_load,
        tightest_ttft_s=slo.profile.tightest_ttft_s,
        shedding=dispatcher.shedding,
    )
    # the priority mapper relaxes a level's floor only while nothing waits for an engine
    slo.backlog = core.backlogged
    return core


def engine_scheduling_warnings(
    routing: RoutingProfile, fleet: Fleet, max_engine_load: int | None
) -> list[str]:
    """What the profile expects of the engines and the settings but does not get, as start-up
    warnings: deadline scheduling on engines that do not take the ``priority`` field (not
    ``priority_scheduling: true``, or a kind that has no such field), shedding without a gateway
    queue to shed from."""
    warnings = []
    dispatcher = routing.dispatcher
    if dispatcher.deadline_engines:
        lacking = sorted(e for e, r in fleet.records.items() if not r.adapter.accepts_priority)
        if lacking:
            warnings.append(
                "the routing profile expects engines that schedule by the TTFT deadline "
                "(engine_scheduling: deadline), but these engines do not take a request priority: "
                f"{', '.join(lacking)}; start them with priority scheduling (vLLM --scheduling-policy "
                "priority) and set priority_scheduling: true in their engine settings, or their "
                "requests are served first come, first served"
            )
    if dispatcher.shedding is not None and dispatcher.hyperflexis is None and max_engine_load is None:
        warnings.append(
            "the routing profile sheds under saturation, but no max_engine_load is set (in the "
            "profile's dispatcher params or the settings): the pipeline dispatcher then never "
            "queues, so nothing is ever shed"
        )
    return warnings


def profile_engine_scheduling(settings: Settings) -> bool:
    """Whether the settings' routing profile expects engines that schedule by the TTFT deadline."""
    return RoutingProfile.load(settings.routing_profile_path()).dispatcher.deadline_engines


def with_profile_engines(settings: Settings) -> Settings:
    """``settings`` with every engine set to priority scheduling when the routing profile expects
    deadline scheduling (``engine_scheduling: deadline``); unchanged otherwise. For drivers that
    start the engines themselves (the offline simulator, the experiment runner): they start each
    engine as its ``priority_scheduling`` says."""
    if not profile_engine_scheduling(settings) or all(e.priority_scheduling for e in settings.engines):
        return settings
    engines = [e.model_copy(update={"priority_scheduling": True}) for e in settings.engines]
    return settings.model_copy(update={"engines": engines})
