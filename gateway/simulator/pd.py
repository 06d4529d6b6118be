"""Prefill/decode disaggregation in the offline simulator: one fleet of prefill and decode
engines behind the gateway's own dispatch core, decode engines placed by the decode stage, KV
moved over each decode engine's ingress link in the order of a transfer policy.

The fleet is the live registry with the engines' roles: the dispatch core (and HyperFlexis's
workers) serve the model's front pool, its prefill engines; the decode stage reads
:meth:`Fleet.decode_pool`. What the live disaggregated flow (``gateway/serving/disaggregated.py``)
does around them is done here at the same moments with the same calls:

* **which path** (:func:`policies.disaggregation.decide_disaggregation` with the routing profile's
  ``disaggregation`` section, or the scenario's override): a request that is not disaggregated
  (``never``, or a prompt shorter than ``min_prompt_tokens`` under ``conditional``) skips the
  admission queue and runs whole on the decode engine the decode stage picks, as live;
* **the prefill**: the dispatch core places it on a prefill engine (the same core, queue order and
  routing profile as collocated); the engine computes the prompt, emits one token and holds the
  KV (vLLM's ``do_remote_decode``); the prefill engine's reservation is released when it answers;
* **the decode engine**, by ``mode``:

  * ``two-stage`` (HyperFlexis §5.1): when the prefill ends,
    :func:`policies.decode_placement.place_decode` over the decode pool's snapshots, each with its
    learnt coefficients (:meth:`SloService.coefficients`) and the record's free KV room, as live;
    its transfers in flight are the decode engine's requests without a first token (queued for
    the link, moving, or arrived and not yet stepped; the live flow now counts only those past
    its transfer gate whose KV is still arriving, ``DisaggregatedFlow._arriving``);
  * ``one-shot`` (peer gateways): the pair is fixed when the prefill is dispatched, the decode
    engine round robin;
  * ``one-shot-least-load`` (a stronger peer baseline): fixed at the same moment, the decode
    engine with the least estimated load (:func:`policies.api.estimated_load`, the shadow counting
    the pairs made since the last scrape);

  in every mode the decode engine's capacity is reserved when it is chosen and released when the
  stream ends;
* **the transfer**: the request waits in the decode engine's link queue; the gateway hands the link
  one transfer at a time (the decode request is sent, and the engine pulls the KV, only when its
  link is free), in the order of :mod:`policies.transfer_order` (FIFO or MFS's RMLQ, the request's
  TTFT deadline less its predicted first decode step as the transfer's explicit deadline). The
  engine's link is :meth:`gateway.sim.engine.EngineModel.reserve_link` (serial). The prefill engine
  frees the held KV when the transfer ends. The client's first token is the decode engine's.

Where this differs from live: the link queue stands in for the live KV-transfer gate
(``dispatch/transfer_gate.py``, asyncio; one transfer per link at a time, its turn ending when the
KV has arrived rather than at the first token); the prefill's ticket and reservation carry one
output token (what the prefill engine produces), where the live flow reserves the client's
``max_tokens`` on the prefill engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gateway.experiments.workload import RequestSpec
from gateway.fleet.registry import EngineRecord, RunningEntry, alone_since
from gateway.settings import Settings
from gateway.sim.engine import SimRequest
from gateway.sim.profiles import EngineProfile
from gateway.simulator.clock import EventQueue
from gateway.simulator.gateway_node import SimGateway, _Flight, engine_prompt
from policies.api import Role, estimated_load
from policies.decode_placement import (
    DecodeCandidate,
    DecodeChoice,
    DecodeDemand,
    place_decode,
)
from policies.disaggregation import DisaggregationMode, DisaggregationParams, decide_disaggregation
from policies.transfer_order import (
    LinkParams,
    TransferOrder,
    TransferQueue,
    TransferRequest,
    make_transfer_order,
)

MODES = ("two-stage", "one-shot", "one-shot-least-load")
ORDERS = ("fifo", "rmlq")


def link_tokens_per_s(profile: EngineProfile) -> float:
    """The profile's link speed in KV tokens per second."""
    if profile.kv_bytes_per_token <= 0:
        return math.inf
    return profile.transfer.link_bandwidth_gbps * 1e9 / profile.kv_bytes_per_token


def disaggregation_params(text: str | None) -> DisaggregationParams | None:
    """``always`` | ``never`` | ``conditional[:min_prompt_tokens]`` (None: None, the profile's)."""
    if text is None:
        return None
    mode, _, threshold = text.partition(":")
    try:
        params = DisaggregationParams(DisaggregationMode(mode))
        if threshold:
            if params.mode is not DisaggregationMode.CONDITIONAL:
                raise ValueError
            params = replace(params, min_prompt_tokens=int(threshold))
    except ValueError:
        raise ValueError(
            f"disaggregation {text!r}: expected always, never or conditional[:min_prompt_tokens]"
        ) from None
    return params


@dataclass(slots=True)
class _Stage:
    """What the P/D flow keeps per request beyond the collocated flight."""

    prompt: list[int]
    prefill_engine: str = ""
    decode_engine: str = ""
    decode_entry: RunningEntry | None = None
    #: the predicted first decode step on the chosen engine (the transfer's deadline margin)
    step_s: float = 0.0
    #: runs whole on the decode engine (not disaggregated)
    whole: bool = False
    #: the prefill stage has ended (the request now waits for, or runs in, the decode pool)
    prefill_done: bool = False


class PdGateway(SimGateway):
    def __init__(
        self,
        settings: Settings,
        profile: EngineProfile,
        clock: EventQueue,
        model: str,
        explicit_slo: bool = True,
        *,
        mode: str = "two-stage",
        transfer_order: str = "fifo",
        disaggregation: DisaggregationParams | None = None,
    ) -> None:
        """``settings.engines`` hold the prefill and decode engines (their ``role``);
        ``disaggregation`` replaces the routing profile's section (None: the profile's)."""
        if mode not in MODES:
            raise ValueError(f"unknown P/D mode {mode!r}; use one of {', '.join(MODES)}")
        super().__init__(settings, clock, model, explicit_slo)
        self.mode = mode
        dispatcher = self.routing.dispatcher
        self.disaggregation = disaggregation or dispatcher.disaggregation
        self.decode_ids = [e.engine_id for e in settings.engines if e.role is Role.DECODE]
        if not self.decode_ids or not self.fleet.has_prefill_pool(model):
            raise ValueError("P/D needs prefill and decode engines (role: prefill, role: decode)")
        speed = link_tokens_per_s(profile)
        # the profile's decode token budget; the link as the simulated hardware has it (what an
        # operator would write in decode_placement for these engines)
        self.placement = replace(
            dispatcher.decode_placement,
            transfer_tokens_per_s=speed,
            transfer_latency_s=profile.transfer.link_latency_s,
        )
        self.order: TransferOrder = make_transfer_order(transfer_order, LinkParams(speed))
        # every engine gets a link queue: a role flip (the autoscaler's) can make any one a decode engine
        every = [e.engine_id for e in settings.engines]
        self.queues: dict[str, TransferQueue] = {d: TransferQueue() for d in every}
        self.link_busy: dict[str, bool] = dict.fromkeys(every, False)
        self.stages: dict[str, _Stage] = {}
        self._rr = 0
        #: requests whose stage each engine ran (prefills on prefill engines, decodes on decode ones)
        self.served: dict[str, int] = {}
        #: requests served whole on a decode engine (not disaggregated)
        self.whole = 0
        #: decode placements place_decode judged feasible / best effort
        self.placements = {"feasible": 0, "best_effort": 0}
        #: prefill stages ended (the decode pool's arrivals, with the whole requests)
        self.prefills_done = 0

    def _placed_output_tokens(self, spec: RequestSpec) -> int:
        return 1  # the prefill engine computes the prompt and emits one token

    # -- the front door: disaggregated or whole on a decode engine -------------------------------

    def _outside_queue(self, flight: _Flight) -> bool:
        decision = decide_disaggregation(flight.entry.prompt_tokens, None, self.disaggregation)
        if decision.disaggregate:
            return False
        engine_id = self._pick_decode(flight, None)
        if engine_id is None:
            self._refused(flight, 503)
            return True
        stage = _Stage(engine_prompt(flight.spec), decode_engine=engine_id, whole=True)
        self.stages[flight.rid] = stage
        entry = self._reserve_decode(flight, stage)
        record = self.fleet.records[engine_id]
        now = self.clock.now
        flight.record = record
        flight.dispatched_at = entry.dispatched_at = now
        spec = flight.spec
        request = SimRequest(
            flight.rid,
            list(stage.prompt),
            spec.bound,
            now,
            priority=self._engine_priority(flight, record),
            ignore_eos=True,
            output_len=spec.output_tokens,
        )
        self.engines[engine_id].add(request)
        self.served[engine_id] = self.served.get(engine_id, 0) + 1
        self.whole += 1
        return True

    # -- stage 1: the prefill, placed by the dispatch core ---------------------------------------

    def _send(self, flight: _Flight, record: EngineRecord) -> None:
        now = self.clock.now
        flight.record = record
        flight.dispatched_at = now
        flight.entry.dispatched_at = now
        flight.entry.alone_since = alone_since(record)
        stage = _Stage(engine_prompt(flight.spec), prefill_engine=record.engine_id)
        self.stages[flight.rid] = stage
        if self.mode != "two-stage":  # the pair is fixed now
            engine_id = self._pick_decode(flight, record.engine_id)
            if engine_id is not None:
                stage.decode_engine = engine_id
                self._reserve_decode(flight, stage)
        request = SimRequest(
            flight.rid,
            list(stage.prompt),
            1,
            now,
            priority=self._engine_priority(flight, record),
            prefill_only=True,
        )
        self.engines[record.engine_id].add(request)
        self.served[record.engine_id] = self.served.get(record.engine_id, 0) + 1

    def on_tokens(
        self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float, deferred: bool = False
    ) -> None:
        if not deferred and self._stalled(self._tokens_late, engine_id, tokens, relayed=True):
            return
        # (read as the gateway handles the engine's news: a stalled one reads them late too)
        self._kv_events(engine_id, now)
        fleet = self.fleet
        record = fleet.records[engine_id]
        for request, _ in tokens:
            if request.prefill_only:  # the prefill's own token: the client never sees it
                flight = self.flights.get(request.request_id)
                if flight is not None:
                    fleet.mark_prefilled(engine_id, request.request_id)
                    self.slo.latency.prefill_answered(record, flight.entry)  # (as live)
                continue
            flight = self.flights.get(request.request_id)
            stage = self.stages.get(request.request_id)
            if flight is None or stage is None or stage.decode_entry is None:
                continue
            if not flight.tokens:
                flight.first_at = now
                # the KV has arrived (or the prompt was computed here): as the live relay does
                fleet.mark_prefilled(engine_id, flight.rid)
            flight.last_at = now
            flight.tokens += 1
            fleet.add_generated(record, stage.decode_entry, 1)

    def on_finished(
        self, engine_id: str, requests: list[SimRequest], now: float, deferred: bool = False
    ) -> None:
        if not deferred and self._stalled(self._finished_late, engine_id, requests, relayed=True):
            return
        # (read as the gateway handles the engine's news: a stalled one reads them late too)
        self._kv_events(engine_id, now)
        decodes = [r for r in requests if not r.prefill_only]
        if decodes:
            super().on_finished(engine_id, decodes, now, True)
        for request in requests:  # prefills done: the prefill engine holds their KV
            if not request.prefill_only:
                continue
            self.fleet.release(engine_id, request.request_id)
            flight = self.flights.get(request.request_id)
            if flight is not None:
                self.prefills_done += 1
                stage = self.stages.get(request.request_id)
                if stage is not None:
                    stage.prefill_done = True
                self._decode_stage(flight)

    def _release(self, engine_id: str, request_id: str) -> None:
        """A decode (or a whole request on a decode engine) ended."""
        self.fleet.release(engine_id, request_id)
        self.stages.pop(request_id, None)

    # -- stage 2: the decode engine, then the KV transfer ----------------------------------------

    def place(self, flight: _Flight, source: str | None) -> DecodeChoice | None:
        """The decode stage's choice now, from what the live flow gives it
        (``DisaggregatedFlow.place_decode``)."""
        fleet = self.fleet
        now = self.clock.now
        candidates = []
        pool = fleet.decode_pool(self.model, now)
        judged = self.slo.decode_judged([s.engine_id for s in pool], flight.entry.prompt_tokens)
        for snap in pool:
            record = fleet.records[snap.engine_id]
            candidates.append(
                DecodeCandidate(
                    snap,
                    judged[snap.engine_id],
                    # a decode engine's requests without a first token are the KV still arriving
                    transfers_in_flight=len(record.unprefilled),
                    free_kv_tokens=record.free_kv_tokens(),
                    tightest_running_tpot_s=record.tightest_tpot(),
                )
            )
        entry = flight.entry
        demand = DecodeDemand(
            flight.rid, entry.prompt_tokens, flight.spec.bound, flight.target.tpot_s, source
        )
        choice = place_decode(demand, candidates, self.placement)
        if choice is not None:
            self.placements["feasible" if choice.feasible else "best_effort"] += 1
        return choice

    def _pick_decode(self, flight: _Flight, source: str | None) -> str | None:
        """The decode engine by this gateway's mode (None: no decode engine in rotation)."""
        if self.mode == "two-stage":
            choice = self.place(flight, source)
            if choice is None:
                return None
            stage = self.stages.get(flight.rid)
            if stage is not None:
                stage.step_s = choice.predicted_tpot_s
            return choice.engine_id
        pool = self.fleet.decode_pool(self.model, self.clock.now)
        if not pool:
            return None
        if self.mode == "one-shot":
            self._rr += 1
            return pool[(self._rr - 1) % len(pool)].engine_id
        return min(pool, key=estimated_load).engine_id  # ties: fleet order

    def _reserve_decode(self, flight: _Flight, stage: _Stage) -> RunningEntry:
        entry = RunningEntry(flight.entry.prompt_tokens, flight.spec.bound, flight.target.tpot_s, 0.0)
        entry.remote_kv = not stage.whole  # its KV comes from the prefill engine (the latency learner)
        stage.decode_entry = entry
        self.fleet.reserve(stage.decode_engine, flight.rid, entry)
        return entry

    def _decode_stage(self, flight: _Flight) -> None:
        stage = self.stages[flight.rid]
        if stage.decode_entry is None:  # two-stage: placed now
            engine_id = self._pick_decode(flight, stage.prefill_engine)
            if engine_id is None:  # no decode engine at all: the prefill's KV is dropped
                self.engines[stage.prefill_engine].release_held(flight.rid)
                self.stages.pop(flight.rid, None)
                self._refused(flight, 503)
                return
            stage.decode_engine = engine_id
            self._reserve_decode(flight, stage)
        deadline = flight.arrival + flight.target.ttft_s - stage.step_s
        engine = stage.decode_engine
        transfer = TransferRequest(flight.rid, flight.entry.prompt_tokens, deadline)
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
        if flight is None or stage is None or stage.decode_entry is None:
            self._pump(engine_id)
            return
        now = self.clock.now
        stage.decode_entry.dispatched_at = now
        node = self.engines[engine_id]
        ready = node.model.reserve_link(len(stage.prompt), now)
        spec = flight.spec
        request = SimRequest(
            rid,
            list(stage.prompt),
            spec.bound,
            now,
            priority=self._engine_priority(flight, self.fleet.records[engine_id]),
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
        self.engines[prefill_engine].release_held(rid)
        self.link_busy[engine_id] = False
        self._pump(engine_id)
