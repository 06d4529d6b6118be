"""One simulated run: a workload replayed against N engines behind the gateway, in virtual time."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.dispatch.build import with_profile_engines
from gateway.experiments.replay import Outcome
from gateway.experiments.workload import OUTPUT_BOUNDS, RequestSpec, with_task_bounds
from gateway.experiments.workloads import load_workload
from gateway.settings import EngineConfig, Settings
from gateway.sim.profiles import EngineProfile, load_profile
from gateway.simulator.autoscale import AutoscaleConfig, Autoscaler, AutoscaleReport
from gateway.simulator.clock import EventQueue
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.engine_node import EngineNode
from gateway.simulator.gateway_node import SimGateway
from policies.api import Role

MODEL = "sim-model"
#: HyperFlexis §7.5: one cost unit is one instance active for 50 ms
COST_UNIT_S = 0.05


@dataclass(frozen=True, slots=True)
class Scenario:
    """Everything one point of a comparison needs; picklable, so points run in worker processes."""

    workload: str
    qps: float
    policy: str  # a routing profile: name in profiles/routing or a path
    engines: int = 4
    engine_profile: str = "qwen-7b"
    slo_profile: str = "hyperflexis-4task"
    requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    #: engines order their own queue by the gateway-supplied TTFT deadline (vLLM --scheduling-policy priority)
    engine_priority: bool = False
    #: requests carry their task's SLO targets as headers; False: only ``x-priority`` (for a
    #: priority profile to map, as in the priority-ramp experiment)
    explicit_slo: bool = True
    monitor_interval_s: float = 1.0
    #: the engines' true speed relative to their profile, which stays the gateway's prior
    #: (0.5: every step takes twice what the gateway was told)
    engine_speed: float = 1.0
    max_engine_load: int | None = None
    #: injected faults (see gateway.simulator.disturbance)
    disturbances: tuple[Disturbance, ...] = ()
    #: extra settings passed to the gateway (any Settings field)
    settings: tuple[tuple[str, object], ...] = field(default=())
    #: prefill/decode disaggregation: (prefill engines, decode engines) instead of ``engines``
    #: collocated ones (gateway.simulator.pd)
    pd: tuple[int, int] | None = None
    #: P/D: ``two-stage`` (decode placed when the prefill ends), ``one-shot`` (pair fixed when the
    #: prefill is dispatched, decode round robin) or ``one-shot-least-load`` (the same, decode by
    #: least load)
    pd_mode: str = "two-stage"
    #: P/D: the order of KV transfers waiting for a decode engine's link: ``fifo`` or ``rmlq``
    transfer_order: str = "fifo"
    #: the engines' KV link bandwidth, GB/s (None: the engine profile's)
    link_gbps: float | None = None
    #: each engine's KV cache in blocks (None: the engine profile's ``num_gpu_blocks``); the
    #: gateway learns it from the scrapes, as live
    num_gpu_blocks: int | None = None
    #: P/D: each decode engine's speed relative to its profile (missing ones: 1), configured as
    #: its ``time_scale`` so the gateway's prior knows it (a slower accelerator in the pool)
    decode_speeds: tuple[float, ...] = ()
    #: P/D: ``always``, ``never`` or ``conditional[:min_prompt_tokens]`` in place of the routing
    #: profile's ``disaggregation`` section (None: the profile's, as live)
    disaggregation: str | None = None
    #: scale the fleet with a scaling policy (gateway.simulator.autoscale): ``engines`` (or ``pd``)
    #: is the fleet at the start, ``autoscale.max_engines`` the slots
    autoscale: AutoscaleConfig | None = None
    #: what the client's ``max_tokens`` tells of each answer: ``exact`` (its own length, as if
    #: known) or ``task-p99`` (its task's 99th percentile; see with_task_bounds)
    output_bound: str = "exact"

    def label(self) -> str:
        scaled = f", {self.autoscale.label()}" if self.autoscale is not None else ""
        if self.pd is not None:
            return f"{self.policy} P/D {self.pd[0]}:{self.pd[1]} {self.pd_mode}{scaled} @ {self.qps:g} QPS"
        return f"{self.policy}{scaled} @ {self.qps:g} QPS"

    def serving_at_start(self) -> dict[str, Role]:
        """The engines serving when the run starts, by role (the rest are autoscaling slots)."""
        if self.pd is None:
            count = self.engines
            if self.autoscale is not None:
                count = max(self.autoscale.min_engines, min(self.autoscale.max_engines, count))
            return {f"sim-{i}": Role.COLLOCATED for i in range(count)}
        prefill, decode = self.pd
        return {
            **{f"prefill-{i}": Role.PREFILL for i in range(prefill)},
            **{f"decode-{i}": Role.DECODE for i in range(decode)},
        }


@dataclass(slots=True)
class RunResult:
    scenario: Scenario
    outcomes: list[Outcome]
    events: int
    wall_s: float
    #: virtual seconds from the first arrival to the last answer
    makespan_s: float
    #: engine-seconds the fleet was provisioned for (engines x makespan), in cost units
    cost_units: float
    #: virtual seconds engines spent running steps, summed over engines
    busy_s: float
    #: per engine: virtual seconds running steps, and requests (or P/D stages) it ran
    busy_by_engine: dict[str, float] = field(default_factory=dict)
    served_by_engine: dict[str, int] = field(default_factory=dict)
    #: engine-seconds the fleet held devices (serving, draining, loading) over the makespan
    engine_s: float = 0.0
    #: with autoscaling: its actions, timeline, warm-pool seconds
    autoscale: AutoscaleReport | None = None


def _engine(
    scenario: Scenario, name: str, role: Role = Role.COLLOCATED, time_scale: float = 1.0
) -> EngineConfig:
    return EngineConfig(
        url=f"http://{name}.invalid:8000",  # type: ignore[arg-type]
        kind="sim",
        model=MODEL,
        name=name,
        latency_profile=scenario.engine_profile,
        priority_scheduling=scenario.engine_priority,
        role=role,
        time_scale=time_scale,
    )


def settings_for(scenario: Scenario) -> Settings:
    """The gateway's settings: ``engines`` collocated engines, or in P/D mode prefill engines
    (``prefill-i``, the front pool the dispatch core serves) and decode engines (``decode-i``)."""
    scaled = scenario.autoscale
    if scenario.pd is None:
        count = scenario.engines if scaled is None else scaled.max_engines
        engines = [_engine(scenario, f"sim-{i}") for i in range(count)]
    else:
        prefill, decode = scenario.pd
        if prefill < 1 or decode < 1:
            raise ValueError(f"P/D needs at least one prefill and one decode engine, got {prefill}:{decode}")
        speeds = scenario.decode_speeds
        if len(speeds) > decode or any(not v > 0 for v in speeds):
            raise ValueError(f"decode_speeds: at most {decode} speeds > 0, got {speeds}")
        engines = [_engine(scenario, f"prefill-{i}", Role.PREFILL) for i in range(prefill)]
        engines += [
            _engine(scenario, f"decode-{i}", Role.DECODE, speeds[i] if i < len(speeds) else 1.0)
            for i in range(decode)
        ]
        if scaled is not None:
            if prefill + decode > scaled.max_engines:
                raise ValueError(
                    f"--pd {prefill}:{decode} is more than {scaled.max_engines} engines (the maximum)"
                )
            # slots the scaler provisions into either pool (role set when they come up)
            spares = scaled.max_engines - prefill - decode
            engines += [_engine(scenario, f"spare-{i}", Role.PREFILL) for i in range(spares)]
    extra: dict[str, Any] = dict(scenario.settings)
    settings = Settings(
        engines=engines,
        routing_profile=scenario.policy,
        slo_profile=scenario.slo_profile,
        monitor_interval_s=scenario.monitor_interval_s,
        max_engine_load=scenario.max_engine_load,
        **extra,
    )
    # a profile that expects deadline scheduling (engine_scheduling: deadline) gets such engines
    return with_profile_engines(settings)


def workload_for(scenario: Scenario) -> list[RequestSpec]:
    if scenario.output_bound not in OUTPUT_BOUNDS:
        raise ValueError(
            f"output_bound must be one of {', '.join(OUTPUT_BOUNDS)}, got {scenario.output_bound!r}"
        )
    specs = load_workload(
        scenario.workload,
        qps=scenario.qps,
        requests=scenario.requests,
        duration_s=scenario.duration_s,
        seed=scenario.seed,
    )
    return with_task_bounds(specs) if scenario.output_bound == "task-p99" else specs


class Simulation:
    """A scenario set up and ready to run: the clock, the simulated gateway and its engines."""

    def __init__(self, scenario: Scenario, workload: Sequence[RequestSpec] | None = None) -> None:
        self.scenario = scenario
        self.specs = list(workload) if workload is not None else workload_for(scenario)
        settings = settings_for(scenario)
        profile = load_profile(scenario.engine_profile, settings.profiles_dir)
        if scenario.link_gbps is not None:
            link = profile.transfer.model_copy(update={"link_bandwidth_gbps": scenario.link_gbps})
            profile = profile.model_copy(update={"transfer": link})
        if scenario.num_gpu_blocks is not None:
            if scenario.num_gpu_blocks < 1:
                raise ValueError(f"num_gpu_blocks must be >= 1, got {scenario.num_gpu_blocks}")
            profile = profile.model_copy(update={"num_gpu_blocks": scenario.num_gpu_blocks})
        self.clock = EventQueue()
        self.gateway = self._gateway(scenario, settings, profile)
        self.nodes = [
            EngineNode(
                engine.engine_id,
                profile,
                self.clock,
                self.gateway,
                priority_scheduling=engine.priority_scheduling,
                # an engine configured with a time_scale runs that much faster than its profile
                slow_factor=1.0 / (scenario.engine_speed * engine.time_scale),
                seed=scenario.seed * 1_000 + i,
            )
            for i, engine in enumerate(settings.engines)
        ]
        #: per engine slowed down: its own speed factor, and the factors of the windows open now
        self._slowdowns: dict[str, tuple[float, list[float]]] = {}
        # (before the engines are attached: a disturbance from t = 0 covers their first scrape)
        for disturbance in scenario.disturbances:
            self._inject(disturbance)
        self.gateway.attach(self.nodes)
        self.autoscaler: Autoscaler | None = None
        if scenario.autoscale is not None:
            self.autoscaler = Autoscaler(
                scenario.autoscale,
                self.gateway,
                self.nodes,
                profile,
                self.clock,
                scenario.serving_at_start(),
                Role.PREFILL if scenario.pd is not None else Role.COLLOCATED,
            )
            self.autoscaler.start()

    def _gateway(self, scenario: Scenario, settings: Settings, profile: EngineProfile) -> SimGateway:
        if scenario.pd is None:
            return SimGateway(settings, self.clock, MODEL, scenario.explicit_slo)
        from gateway.simulator.pd import PdGateway, disaggregation_params

        return PdGateway(
            settings,
            profile,
            self.clock,
            MODEL,
            scenario.explicit_slo,
            mode=scenario.pd_mode,
            transfer_order=scenario.transfer_order,
            disaggregation=disaggregation_params(scenario.disaggregation),
        )

    def _inject(self, disturbance: Disturbance) -> None:
        if disturbance.kind == "slow-engine":
            nodes = {node.engine_id: node for node in self.nodes}
            if disturbance.engine is not None and disturbance.engine not in nodes:
                raise ValueError(
                    f"slow-engine: no engine {disturbance.engine!r} (engines: {', '.join(nodes)})"
                )
            node = nodes[disturbance.engine] if disturbance.engine else self.nodes[0]
            model = node.model
            # windows on one engine compound while they overlap, and each one's end takes back
            # its own factor only (the engine's own speed, times those still open)
            normal, open_windows = self._slowdowns.setdefault(node.engine_id, (model.slow_factor, []))
            magnitude = disturbance.magnitude

            def slow_down(opening: bool) -> None:
                if opening:
                    open_windows.append(magnitude)
                else:
                    open_windows.remove(magnitude)
                model.slow_factor = math.prod(open_windows, start=normal)

            self.clock.at(disturbance.start_s, slow_down, True)
            self.clock.at(disturbance.end_s, slow_down, False)
        else:
            self.gateway.disturbances.append(disturbance)

    def run(self, progress: Callable[[int, int], None] | None = None) -> RunResult:
        """Replay the workload; ``progress(done, total)`` is called as requests finish (every 2 %)."""
        specs, clock, gateway, scenario = self.specs, self.clock, self.gateway, self.scenario
        total = len(specs)
        # arrivals are fed one ahead, so the event heap holds O(in flight) entries, not the workload
        feed = iter(specs)

        def arrive(spec: RequestSpec) -> None:
            gateway.arrive(spec)
            following = next(feed, None)
            if following is not None:
                clock.at(following.at, arrive, following)

        first = next(feed, None)
        if first is not None:
            clock.at(first.at, arrive, first)
        every = max(1, total // 50)
        reported = 0

        def finished() -> bool:
            nonlocal reported
            done = len(gateway.outcomes)
            if progress is not None and done - reported >= every:
                reported = done
                progress(done, total)
            return done >= total

        started = time.perf_counter()
        clock.run(stop=finished)
        gateway.stop_scrapes()
        wall = time.perf_counter() - started
        if progress is not None:
            progress(len(gateway.outcomes), total)
        if len(gateway.outcomes) < total:
            raise RuntimeError(
                f"{scenario.label()}: the simulation ran out of events with "
                f"{total - len(gateway.outcomes)} requests unanswered (a dispatcher that never places them?)"
            )
        outcomes = sorted(gateway.outcomes, key=lambda o: o.start_s)
        start = specs[0].at if specs else 0.0
        makespan = max((o.start_s + o.e2e_s for o in outcomes), default=start) - start
        report = None
        engine_s = len(self.nodes) * makespan
        if self.autoscaler is not None:
            report = self.autoscaler.finish(start, start + makespan)
            engine_s = report.engine_s
        return RunResult(
            scenario,
            outcomes,
            clock.events,
            wall,
            makespan,
            engine_s / COST_UNIT_S,
            sum(node.busy_s for node in self.nodes),
            {node.engine_id: node.busy_s for node in self.nodes},
            self._served(),
            engine_s,
            report,
        )

    def _served(self) -> dict[str, int]:
        served = getattr(self.gateway, "served", None)
        if isinstance(served, dict):
            return {node.engine_id: served.get(node.engine_id, 0) for node in self.nodes}
        counts = {node.engine_id: 0 for node in self.nodes}
        for outcome in self.gateway.outcomes:
            if outcome.engine in counts:
                counts[outcome.engine] += 1
        return counts


def run(
    scenario: Scenario,
    workload: Sequence[RequestSpec] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    """Replay the scenario's workload (or ``workload``) and return every request's outcome."""
    return Simulation(scenario, workload).run(progress)
