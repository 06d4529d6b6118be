"""Prefill/decode disaggregation in the offline simulator: prefill engines behind the gateway's own
dispatch core, decode engines placed by the decode stage, KV moved over each decode engine's
ingress link in the order of a transfer policy.

One request: the dispatch core places its prefill on a prefill engine (the same core, queue order
and routing profile as collocated; the engine computes the prompt, emits one token and holds the
KV, vLLM's ``do_remote_decode``). When the prefill ends, the decode engine is chosen:

* ``two-stage`` (HyperFlexis §5.1, the Migrator): :func:`policies.decode_placement.place_decode`
  with the decode fleet's state of that moment (the gateway's shadow of each decode engine,
  its last scrape's KV room, the transfers queued or running into it);
* ``one-shot`` (what peer gateways do): the pair was fixed when the prefill was dispatched, the
  decode engine by round robin (with a pipeline profile that never queues, at arrival).

The KV transfer then waits in the decode engine's link queue; the gateway hands the link one
transfer at a time (the decode request is sent, and the engine pulls the KV, only when its link is
free), in the order of :mod:`policies.transfer_order` (FIFO or MFS's RMLQ, with the request's TTFT
deadline less its predicted first decode step as the transfer's explicit deadline). The engine's
link is :meth:`gateway.sim.engine.EngineModel.reserve_link` (serial). The prefill engine frees the
held KV when the transfer ends. The client's first token is the decode engine's first token.

Workaround: the committed fleet registry routes only collocated engines from the admission queue,
so the prefill engines are given to the core as a fleet of their own (configured collocated: they
only ever receive prefills here) and the decode engines live in a second fleet the decode stage
reads. The decode stage uses each decode engine's profile coefficients (its prior), not a learnt
model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.dispatch.offline import fleet_of
from gateway.experiments.workload import RequestSpec
from gateway.fleet.registry import EngineRecord, RunningEntry
from gateway.settings import EngineConfig, Settings
from gateway.sim.engine import SimRequest
from gateway.sim.profiles import EngineProfile
from gateway.simulator.clock import EventQueue
from gateway.simulator.engine_node import EngineNode
from gateway.simulator.gateway_node import _MAX_PRIORITY, SimGateway, _Flight, engine_prompt
from policies.api import Role
from policies.decode_placement import (
    DecodeCandidate,
    DecodeDemand,
    DecodePlacementParams,
    place_decode,
)
from policies.transfer_order import (
    LinkParams,
    TransferOrder,
    TransferQueue,
    TransferRequest,
    make_transfer_order,
)

MODES = ("two-stage", "one-shot")
ORDERS = ("fifo", "rmlq")


def link_tokens_per_s(profile: EngineProfile) -> float:
    """The profile's link speed in KV tokens per second."""
    if profile.kv_bytes_per_token <= 0:
        return math.inf
    return profile.transfer.link_bandwidth_gbps * 1e9 / profile.kv_bytes_per_token


@dataclass(slots=True)
class _Stage:
    """What the P/D flow keeps per request beyond the collocated flight."""

    prompt: list[int]
    prefill_engine: str = ""
    decode_engine: str = ""
    decode_entry: RunningEntry | None = None
    #: the predicted first decode step on the chosen engine (the transfer's deadline margin)
    step_s: float = 0.0


class PdGateway(SimGateway):
    def __init__(
        self,
        settings: Settings,
        decode_configs: list[EngineConfig],
        profile: EngineProfile,
        clock: EventQueue,
        model: str,
        explicit_slo: bool = True,
        *,
        mode: str = "two-stage",
        transfer_order: str = "fifo",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown P/D mode {mode!r}; use {' or '.join(MODES)}")
        super().__init__(settings, clock, model, explicit_slo)
        self.mode = mode
        self.decode_fleet = fleet_of(decode_configs, settings.stale_after_s)
        self.decode_ids = [c.engine_id for c in decode_configs]
        self.coefficients = profile.latency.coefficients
        speed = link_tokens_per_s(profile)
        self.placement = DecodePlacementParams(
            transfer_tokens_per_s=speed, transfer_latency_s=profile.transfer.link_latency_s
        )
        self.order: TransferOrder = make_transfer_order(transfer_order, LinkParams(speed))
        self.queues: dict[str, TransferQueue] = {d: TransferQueue() for d in self.decode_ids}
        self.link_busy: dict[str, bool] = dict.fromkeys(self.decode_ids, False)
        self.stages: dict[str, _Stage] = {}
        self._rr = 0
        #: requests whose stage each engine ran (prefills on prefill engines, decodes on decode ones)
        self.served: dict[str, int] = {}

    def _placed_output_tokens(self, spec: RequestSpec) -> int:
        return 1  # the prefill engine computes the prompt and emits one token

    def _scrape(self, engine_id: str) -> None:
        fleet = self.decode_fleet if engine_id in self.queues else self.fleet
        fleet.record_state(engine_id, self.engines[engine_id].state(), self.clock.now)

    # -- stage 1: the prefill, placed by the dispatch core ---------------------------------------

    def _send(self, flight: _Flight, record: EngineRecord) -> None:
        now = self.clock.now
        flight.record = record
        flight.dispatched_at = now
        flight.entry.dispatched_at = now
        priority = 0
        if record.adapter.accepts_priority:
            deadline_ms = int((flight.arrival + flight.target.ttft_s) * 1000)
            priority = record.adapter.engine_priority(max(-_MAX_PRIORITY, min(_MAX_PRIORITY, deadline_ms)))
        prompt = engine_prompt(flight.spec)
        stage = _Stage(prompt, prefill_engine=record.engine_id)
        if self.mode == "one-shot":
            stage.decode_engine = self.decode_ids[self._rr % len(self.decode_ids)]
            self._rr += 1
        self.stages[flight.rid] = stage
        request = SimRequest(flight.rid, list(prompt), 1, now, priority=priority, prefill_only=True)
        self.engines[record.engine_id].add(request)
        self.served[record.engine_id] = self.served.get(record.engine_id, 0) + 1

    def on_tokens(
        self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float, deferred: bool = False
    ) -> None:
        if not deferred and self._stalled(self._tokens_late, engine_id, tokens):
            return
        if engine_id not in self.queues:
            for request, _ in tokens:  # the prefill's own token: the client never sees it
                if request.request_id in self.flights:
                    self.fleet.mark_prefilled(engine_id, request.request_id)
            return
        record = self.decode_fleet.records[engine_id]
        for request, _ in tokens:
            flight = self.flights.get(request.request_id)
            stage = self.stages.get(request.request_id)
            if flight is None or stage is None or stage.decode_entry is None:
                continue
            if not flight.tokens:
                flight.first_at = now
                self.decode_fleet.mark_prefilled(engine_id, flight.rid)
            flight.last_at = now
            flight.tokens += 1
            self.decode_fleet.add_generated(record, stage.decode_entry, 1)

    def on_finished(
        self, engine_id: str, requests: list[SimRequest], now: float, deferred: bool = False
    ) -> None:
        if not deferred and self._stalled(self._finished_late, engine_id, requests):
            return
        if engine_id in self.queues:
            super().on_finished(engine_id, requests, now, True)
            return
        for request in requests:  # prefills done: the prefill engine holds their KV
            self.fleet.release(engine_id, request.request_id)
            flight = self.flights.get(request.request_id)
            if flight is not None:
                self._decode_stage(flight)

    def _release(self, engine_id: str, request_id: str) -> None:
        """A decode ended (only decodes reach the collocated ending)."""
        self.decode_fleet.release(engine_id, request_id)
        self.stages.pop(request_id, None)

    # -- stage 2: the decode engine, then the KV transfer ----------------------------------------

    def _decode_stage(self, flight: _Flight) -> None:
        stage = self.stages[flight.rid]
        spec = flight.spec
        if self.mode == "two-stage":
            now = self.clock.now
            candidates = []
            for engine_id in self.decode_ids:
                record = self.decode_fleet.records[engine_id]
                if not record.healthy:
                    continue
                waiting = len(self.queues[engine_id]) + (1 if self.link_busy[engine_id] else 0)
                candidates.append(
                    DecodeCandidate(
                        self.decode_fleet.engine_snapshot(engine_id, now),
                        self.coefficients,
                        waiting,
                        record.free_kv_tokens(),
                    )
                )
            demand = DecodeDemand(
                flight.rid, len(stage.prompt), spec.output_tokens, flight.target.tpot_s, stage.prefill_engine
            )
            choice = place_decode(demand, candidates, self.placement)
            if choice is None:  # no decode engine at all: the prefill's KV is dropped
                self.engines[stage.prefill_engine].model.release_held(flight.rid)
                self.stages.pop(flight.rid, None)
                self._refused(flight, 503)
                return
            stage.decode_engine = choice.engine_id
            stage.step_s = choice.predicted_tpot_s
        entry = RunningEntry(len(stage.prompt), spec.output_tokens, flight.target.tpot_s, self.clock.now)
        entry.prefilled = True
        stage.decode_entry = entry
        self.decode_fleet.reserve(stage.decode_engine, flight.rid, entry)
        deadline = flight.arrival + flight.target.ttft_s - stage.step_s
        engine = stage.decode_engine
        transfer = TransferRequest(flight.rid, len(stage.prompt), deadline)
        self.queues[engine] = self.order.push(self.queues[engine], transfer, self.clock.now)
        self._pump(engine)

    def _pump(self, engine_id: str) -> None:
        """Hand the link its next transfer when it is free."""
        if self.link_busy[engine_id]:
            return
        entry, self.queues[engine_id] = self.order.pop(self.queues[engine_id], self.clock.now)
        if entry is None:
            return
        rid = entry.request.request_id
        flight = self.flights.get(rid)
        stage = self.stages.get(rid)
        if flight is None or stage is None:
            self._pump(engine_id)
            return
        now = self.clock.now
        node = self.engines[engine_id]
        ready = node.model.reserve_link(entry.request.tokens, now)
        spec = flight.spec
        request = SimRequest(
            rid,
            list(stage.prompt),
            spec.output_tokens,
            now,
            ignore_eos=True,
            output_len=spec.output_tokens,
            remote_kv=True,
            kv_ready_at=ready,
        )
        node.add(request)
        self.served[engine_id] = self.served.get(engine_id, 0) + 1
        self.link_busy[engine_id] = True
        self.clock.at(ready, self._transferred, engine_id, stage.prefill_engine, rid)

    def _transferred(self, engine_id: str, prefill_engine: str, rid: str) -> None:
        self.engines[prefill_engine].model.release_held(rid)
        self.link_busy[engine_id] = False
        self._pump(engine_id)


def pd_engines(
    settings: Settings, profile: EngineProfile, decode: int, engine_profile: str, priority: bool
) -> list[EngineConfig]:
    """``decode`` decode-engine configurations beside the settings' prefill engines."""
    return [
        EngineConfig(
            url=f"http://decode-{i}.invalid:8000",  # type: ignore[arg-type]
            kind="sim",
            model=settings.engines[0].model if settings.engines else profile.model,
            name=f"decode-{i}",
            latency_profile=engine_profile,
            priority_scheduling=priority,
            role=Role.DECODE,
        )
        for i in range(decode)
    ]


def build_nodes(
    gateway: PdGateway,
    settings: Settings,
    decode_configs: list[EngineConfig],
    profile: EngineProfile,
    clock: EventQueue,
    slow_factor: float,
    seed: int,
) -> list[EngineNode]:
    nodes = [
        EngineNode(
            c.engine_id,
            profile,
            clock,
            gateway,
            priority_scheduling=c.priority_scheduling,
            slow_factor=slow_factor,
            seed=seed * 1_000 + i,
        )
        for i, c in enumerate([*settings.engines, *decode_configs])
    ]
    gateway.attach(nodes)
    return nodes
