"""The gateway in virtual time: the live gateway's dispatch core, SLO service and fleet registry,
driven by the simulator's clock instead of asyncio.

What the live front door, serving flow and monitor do around the core is done here at the same
moments and with the same calls: classification from the request's SLO headers
(:meth:`SloService.classify`), tickets and submission (:meth:`DispatchCore.ticket`,
:meth:`DispatchCore.submit`), the loop's step / deliver / timer (as :class:`DispatchLoop`),
reservation release when a stream ends, first-token and token accounting (through which the
latency learner sees each engine step, as live), the priority mapper's windows
(:meth:`SloService.learn`) and periodic scrapes of each engine's metrics. The gateway therefore
knows the engines only as it does live: its own shadow and state as of the last scrape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.api.errors import GatewayError
from gateway.api.request_parse import chat_prompt_estimate
from gateway.dispatch.build import RoutingProfile, build_core, build_prefix_routing
from gateway.dispatch.offline import fleet_of
from gateway.dispatch.slo_service import SloService
from gateway.experiments.prompts import prompt_token_ids
from gateway.experiments.replay import Outcome
from gateway.experiments.workload import RequestSpec
from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.kv_events import Cleared, Event, Removed, Stored, apply_events
from gateway.fleet.registry import EngineRecord, RunningEntry
from gateway.settings import Settings
from gateway.sim.engine import SimRequest
from gateway.sim.kv_cache import BlockRemoved, BlockStored, KVEvent
from gateway.simulator.clock import EventQueue
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.engine_node import EngineNode
from gateway.tokenizer import encode
from policies.api import EngineState, RequestView
from policies.plugins.affinity import affinity_key
from policies.slo import SloTarget

#: what the chat template wraps one user message in (the simulated engine applies ChatML)
_TEMPLATE_HEAD = tuple(encode("<|im_start|>user\n"))
_TEMPLATE_TAIL = tuple(encode("<|im_end|>\n<|im_start|>assistant\n"))


def engine_prompt(spec: RequestSpec) -> list[int]:
    """The token ids the simulated engine computes for the spec's chat request."""
    return [*_TEMPLATE_HEAD, *prompt_token_ids(spec), *_TEMPLATE_TAIL]


def index_event(event: KVEvent) -> Event:
    """A simulated engine's KV event as the live subscriber decodes it from the wire."""
    if isinstance(event, BlockStored):
        return Stored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,
            None,
        )
    if isinstance(event, BlockRemoved):
        return Removed(list(event.block_hashes))
    return Cleared()


@dataclass(slots=True)
class _Flight:
    spec: RequestSpec
    rid: str
    #: when the gateway took the request in (its clock; later than sent during a stall)
    arrival: float
    target: SloTarget
    priority: int | None
    entry: RunningEntry
    record: EngineRecord | None = None
    dispatched_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    tokens: int = 0


class SimGateway:
    def __init__(self, settings: Settings, clock: EventQueue, model: str, explicit_slo: bool = True) -> None:
        """``explicit_slo``: requests carry their task's targets as headers (else only their
        priority, for the SLO profile to map), as :func:`gateway.experiments.replay.replay`."""
        self.settings = settings
        self.explicit_slo = explicit_slo
        self.clock = clock
        self.model = model
        self.fleet = fleet_of(settings.engines, settings.stale_after_s)
        self.slo = SloService(settings)
        # latency learning from the engine steps, on the virtual clock: a step's tokens arrive at
        # one instant, so any gap separates two steps
        self.slo.attach(self.fleet, lambda: clock.now, 0.0)
        self.routing = RoutingProfile.load(settings.routing_profile_path())
        # the live gateway's prefix index and affinity store (when the profile reads them), fed by
        # the dispatches and by the engines' KV events, as live
        self.prefix = build_prefix_routing(settings, self.fleet, self.routing)
        self.core = build_core(settings, self.fleet, self.slo, self.routing, self.prefix)
        self.core.wake = self._wake
        self.core.clock = lambda: clock.now
        self.engines: dict[str, EngineNode] = {}
        self.flights: dict[str, _Flight] = {}
        self.outcomes: list[Outcome] = []
        self._count = 0
        self._step_due = False
        self._timer_at = math.inf
        self._timer_version = 0
        self._scraping = True
        #: injected scrape blackouts and stalls (gateway.simulator.disturbance)
        self.disturbances: list[Disturbance] = []
        #: per channel (an engine's connection, or the gateway's own events: ""), the latest
        #: time an event held back by a disturbance is handled at
        self._held_until: dict[str, float] = {}

    # -- engines and scrapes -----------------------------------------------------------------------

    def attach(self, engines: Sequence[EngineNode]) -> None:
        """The engines behind the gateway; each is scraped every monitor interval, in staggered
        phases as the live monitor's checks land, the first scrape at once."""
        interval = self.settings.monitor_interval_s
        for i, node in enumerate(engines):
            self.engines[node.engine_id] = node
            self._scrape(node.engine_id)
            self.clock.at(
                self.clock.now + interval * (i + 1) / len(engines),
                self._scrape_every,
                node.engine_id,
                daemon=True,
            )

    def stop_scrapes(self) -> None:
        self._scraping = False

    def _scrape(self, engine_id: str) -> None:
        """The engine's state as it is now, and its health check's round trip: under a relay
        delay both answers reach the gateway that much later, as the engine's tokens do (one path
        back, one busy relay: live, a loaded gateway reads them late too); the scrape is recorded
        with its send time and what was in flight then, as the live monitor records it."""
        state = self.engines[engine_id].state()
        # (a stalled gateway reads the answers late too: the same loop handles them)
        delay = (
            (self._disturbed("relay-delay") or 0.0) + (self._disturbed("gateway-stall") or 0.0)
            if self.disturbances
            else 0.0
        )
        # (the monitor's health check of the same tick: nothing to do at the engine, the path's
        # delay back)
        self.fleet.record_round_trip(engine_id, delay)
        if not delay:
            self.fleet.record_state(engine_id, state, self.clock.now)
            return
        record = self.fleet.records[engine_id]
        sent = (self.clock.now, (record.in_flight, record.in_flight_tokens))
        self.clock.at(self.clock.now + delay, self._scraped, engine_id, state, sent)

    def _scraped(
        self, engine_id: str, state: EngineState | None, sent: tuple[float, tuple[int, int]]
    ) -> None:
        if self.fleet.records[engine_id].scrape_sent_at > sent[0]:
            return  # a later scrape came back first (the delay ended meanwhile): this one is old news
        self.fleet.record_state(engine_id, state, self.clock.now, *sent)

    def _scrape_every(self, engine_id: str) -> None:
        if not self._scraping:
            return
        if self._disturbed("stale-scrapes") is None:
            self._scrape(engine_id)
        else:
            self.fleet.touch(engine_id)  # (as the live monitor's tick: its staleness is re-read)
            # the scrape gets no answer: the live monitor gives up after its timeout and says so
            # (past stale_after_s, placements stop reading the frozen KV use)
            self.clock.at(
                self.clock.now + self.settings.scrape_timeout_s,
                self._scrape_timed_out,
                engine_id,
                daemon=True,
            )
        self.clock.at(
            self.clock.now + self.settings.monitor_interval_s, self._scrape_every, engine_id, daemon=True
        )

    def _scrape_timed_out(self, engine_id: str) -> None:
        self.fleet.scrape_failed(engine_id, self.clock.now)

    def _disturbed(self, kind: str) -> float | None:
        """The magnitude of a disturbance of ``kind`` in effect now, else None."""
        now = self.clock.now
        for d in self.disturbances:
            if d.kind == kind and d.covers(now):
                return d.magnitude
        return None

    def _stalled(self, fn: Callable[..., None], *args: Any, relayed: bool = False) -> bool:
        """During a gateway stall, handle ``fn(*args)`` that much later (once); True if deferred.
        ``relayed``: an engine's token or end, which a relay delay holds back as well."""
        if not self.disturbances:
            return False
        delay = self._disturbed("gateway-stall") or 0.0
        if relayed:
            delay += self._disturbed("relay-delay") or 0.0
        now = self.clock.now
        # an engine's tokens and ends come over its connection: never before what was held
        # back of it earlier (at a window's end a token made after it overtook the ones made
        # just before, and a stream's finish its last tokens); the gateway's own events keep
        # their order likewise
        channel = args[0] if relayed else ""
        held = self._held_until.get(channel, -math.inf)
        if not delay and held <= now:
            return False
        when = max(now + delay, held)
        self._held_until[channel] = when
        self.clock.at(when, fn, *args, True)
        return True

    # -- the front door: one request arrives -------------------------------------------------------

    def arrive(self, spec: RequestSpec, deferred: bool = False) -> None:
        if not deferred and self._stalled(self.arrive, spec):
            return
        now = self.clock.now
        self._count += 1
        rid = f"sg-sim-{self._count}"
        # the headers a client replaying the workload sends (gateway.experiments.replay)
        headers = {b"x-priority": str(spec.priority).encode()}
        if self.explicit_slo:
            headers[b"x-slo-task"] = spec.task.encode()
            headers[b"x-slo-ttft-ms"] = f"{spec.ttft_s * 1000:.3f}".encode()
            headers[b"x-slo-tpot-ms"] = f"{spec.tpot_s * 1000:.3f}".encode()
        target, priority = self.slo.classify(headers, None, model=self.model)
        self.slo.started(priority)
        estimate = chat_prompt_estimate(1, spec.prompt_tokens)
        output = self._placed_output_tokens(spec)
        view = RequestView(
            request_id=rid,
            model=self.model,
            prompt_tokens=estimate,
            max_output_tokens=output,
            arrival=now,
            priority=priority if priority is not None else 0,
            task=target.slo_class,
        )
        entry = RunningEntry(estimate, output, target.tpot_s, 0.0)
        flight = _Flight(spec, rid, now, target, priority, entry)
        self.flights[rid] = flight
        if self.prefix is not None:
            # what the front door attaches: the prompt as the engine tokenizes it, the session
            blocks = None
            if self.prefix.index is not None:
                blocks = PromptBlocks(engine_prompt(spec), root_key(self.model))
            self.prefix.attach(rid, blocks, affinity_key("default", spec.session))
        if self._outside_queue(flight):
            return
        ticket = self.core.ticket(view, target.ttft_s, target.tpot_s, target.slo_class, entry, now)
        try:
            record = self.core.submit(ticket, now)
        except GatewayError as exc:
            self._refused(flight, exc.status)
            self._deliver()
            return
        if record is not None:
            self._send(flight, record)
        self._deliver()

    def _outside_queue(self, flight: _Flight) -> bool:
        """Serve ``flight`` without the admission queue, as the front door does for some
        requests (a P/D model's short prompts run whole on a decode engine); True if it did."""
        return False

    def _placed_output_tokens(self, spec: RequestSpec) -> int:
        """Output tokens the gateway expects the engine it places on to produce: the client's
        bound (a prefill engine in P/D produces one)."""
        return spec.bound

    # -- the dispatch loop, as DispatchLoop runs it ------------------------------------------------

    def _wake(self) -> None:
        if not self._step_due:
            self._step_due = True
            self.clock.soon(self._step)

    def _step(self, deferred: bool = False) -> None:
        if not deferred and self._stalled(self._step):
            return
        self._step_due = False
        self.core.step(self.clock.now)
        self._deliver()
        self._arm(self.core.next_wake(self.clock.now))

    def _arm(self, at: float) -> None:
        if at == self._timer_at:
            return
        self._timer_version += 1  # the timer set before, if any, no longer fires
        if at <= self.clock.now:
            self._timer_at = math.inf
            self._wake()
            return
        self._timer_at = at
        if at != math.inf:
            self.clock.at(at, self._fire, self._timer_version)

    def _fire(self, version: int) -> None:
        if version == self._timer_version:
            self._timer_at = math.inf
            self._wake()

    def _deliver(self) -> None:
        outbox = self.core.outbox
        if not outbox:
            return
        self.core.outbox = []
        for rid, result in outbox:
            flight = self.flights.get(rid)
            if flight is None:
                continue
            if isinstance(result, EngineRecord):
                self._send(flight, result)
            else:
                self._refused(flight, result.status)

    # -- the serving flow: send, relay, finish -----------------------------------------------------

    def _send(self, flight: _Flight, record: EngineRecord) -> None:
        now = self.clock.now
        flight.record = record
        flight.dispatched_at = now
        flight.entry.dispatched_at = now
        spec = flight.spec
        request = SimRequest(
            flight.rid,
            engine_prompt(spec),
            spec.bound,
            now,
            priority=self._engine_priority(flight, record),
            ignore_eos=True,
            output_len=spec.output_tokens,
        )
        self.engines[record.engine_id].add(request)

    @staticmethod
    def _engine_priority(flight: _Flight, record: EngineRecord) -> int:
        """The live flow's engine priority: the TTFT deadline (on the virtual clock), a late
        request's after every on-time one (0 for an engine that takes none)."""
        adapter = record.adapter
        if not adapter.accepts_priority:
            return 0
        return adapter.deadline_priority(flight.arrival + flight.target.ttft_s, flight.entry.late)

    def on_tokens(
        self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float, deferred: bool = False
    ) -> None:
        if not deferred and self._stalled(self._tokens_late, engine_id, tokens, relayed=True):
            return
        # (read as the gateway handles the engine's news: a stalled one reads them late too)
        self._kv_events(engine_id, now)
        flights = self.flights
        fleet = self.fleet
        for request, _ in tokens:
            flight = flights.get(request.request_id)
            if flight is None or flight.record is None:
                continue
            if not flight.tokens:
                flight.first_at = now
                fleet.mark_prefilled(engine_id, flight.rid)
            flight.last_at = now
            flight.tokens += 1
            fleet.add_generated(flight.record, flight.entry, 1)

    def _tokens_late(self, engine_id: str, tokens: list[tuple[SimRequest, int]], deferred: bool) -> None:
        self.on_tokens(engine_id, tokens, self.clock.now, deferred)

    def _finished_late(self, engine_id: str, requests: list[SimRequest], deferred: bool) -> None:
        self.on_finished(engine_id, requests, self.clock.now, deferred)

    def on_finished(
        self, engine_id: str, requests: list[SimRequest], now: float, deferred: bool = False
    ) -> None:
        if not deferred and self._stalled(self._finished_late, engine_id, requests, relayed=True):
            return
        # (read as the gateway handles the engine's news: a stalled one reads them late too)
        self._kv_events(engine_id, now)
        for request in requests:
            flight = self.flights.pop(request.request_id, None)
            if flight is None:
                continue
            if self.prefix is not None:
                self.prefix.detach(flight.rid)
            self._release(engine_id, flight.rid)
            # the client's view: from when it sent the request (the workload's arrival time)
            sent = flight.spec.at
            ttft = flight.first_at - sent if flight.tokens else math.inf
            tpot = (flight.last_at - flight.first_at) / (flight.tokens - 1) if flight.tokens > 1 else 0.0
            if flight.tokens:
                self.slo.learn(
                    flight.priority,
                    flight.dispatched_at - flight.arrival,
                    flight.first_at - flight.arrival,  # the gateway's view, as live
                    tpot if flight.tokens > 1 else None,
                )
            self.slo.left(flight.priority)
            self._outcome(flight, 200, ttft, tpot, now - sent, engine_id)

    def _release(self, engine_id: str, request_id: str) -> None:
        """The request left the engine: its reservation goes back (the serving flow's release)."""
        self.fleet.release(engine_id, request_id)

    def _kv_events(self, engine_id: str, now: float) -> None:
        """The engine's KV events since the last step, into the prefix index (drained either way:
        the engine model keeps them until someone does)."""
        node = self.engines.get(engine_id)
        if node is None:
            return
        events = node.model.cache.drain_events()
        if events and self.prefix is not None and self.prefix.index is not None:
            apply_events(self.prefix.index, engine_id, [index_event(e) for e in events], now)

    def _refused(self, flight: _Flight, status: int) -> None:
        self.flights.pop(flight.rid, None)
        if self.prefix is not None:
            self.prefix.detach(flight.rid)
        self.slo.left(flight.priority)
        self._outcome(flight, status, math.inf, 0.0, self.clock.now - flight.spec.at, "")

    def _outcome(
        self, flight: _Flight, status: int, ttft: float, tpot: float, e2e: float, engine: str
    ) -> None:
        self.outcomes.append(
            Outcome(
                flight.spec,
                status,
                ttft,
                tpot,
                e2e,
                flight.tokens,
                flight.spec.at,
                engine,
                flight.target.ttft_s,
                flight.target.tpot_s,
            )
        )
