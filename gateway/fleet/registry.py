"""The fleet registry: every engine the gateway knows, its health and its shadow of in-flight work.

The monitor writes scraped state and health here; the dispatch loop reserves an engine's capacity
the moment it assigns a request (:meth:`Fleet.reserve`) and the serving flow releases it when the
request leaves the engine (:meth:`Fleet.release`), so decisions never wait for the next scrape
and two assignments in one dispatch pass see each other. Policies only ever see the immutable
:class:`FleetSnapshot` built from it.

Snapshots are incremental: a change to one engine rebuilds that engine's
:class:`EngineSnapshot` only, and the fleet tuple is a C-level copy of cached references, so a
dispatch at 256 engines does not pay for 256 engines on every reservation.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from gateway.engines import EngineAdapter
from gateway.fleet.rank_index import RankIndex, RankKey
from policies.api import EngineSnapshot, EngineState, FleetSnapshot, Role, load_of
from policies.stall import is_stalled

log = logging.getLogger("slogate.fleet")


@dataclass(slots=True)
class RunningEntry:
    """One request this gateway has in flight on an engine (the dispatcher's shadow of it)."""

    prompt_tokens: int
    max_tokens: int
    tpot_slo: float
    dispatched_at: float
    generated: int = 0
    prefilled: bool = False
    #: called once when the first token arrives (a decode stage's KV transfer is over by then)
    on_prefilled: Callable[[], None] | None = None
    #: a P/D decode stage: its prompt's KV comes from a prefill engine, so its first token is a
    #: decode step there, not a prefill
    remote_kv: bool = False
    #: prompt tokens the dispatcher expected the engine to find in its prefix cache: they wait
    #: for no prefill there; and of those, the ones in blocks that requests running there share:
    #: they take no new KV (set per reservation; 0 when nothing is known)
    cached_tokens: int = 0
    shared_tokens: int = 0
    #: dispatched with its TTFT already lost (HyperFlexis's late or idle backfill): an engine that
    #: schedules by deadline runs it after every request that can still make its own
    late: bool = False
    #: a streamed request (its events are progress as they come; a non-streamed one shows none
    #: until it ends)
    stream: bool = True
    #: when the engine could start on it, if later than its dispatch: a P/D decode sent alongside
    #: its prefill (bootstrap) waits for that prefill's KV (inf until the prefill answers); what
    #: a stall is timed from
    ready_at: float = 0.0
    #: a P/D prefill stage's engine's reservation count when it was sent, if it was alone there
    #: then (-1 if not): the latency learner times it when no other request of this gateway came
    #: or ran there until its answer
    alone_since: int = -1


#: the most output tokens one streamed event is taken to carry (a bound on a broken usage)
MAX_TOKENS_PER_EVENT = 16.0
#: health-check round trips an engine's path delay is the least of
ROUND_TRIPS_KEPT = 8


@dataclass(slots=True)
class EngineRecord:
    """Mutable, gateway-private view of one engine. Only the event loop thread touches it."""

    adapter: EngineAdapter
    index: int = 0
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    state: EngineState | None = None
    state_at: float = 0.0
    #: scrapes have failed for longer than the fleet's ``stale_after_s``: the KV use ``state``
    #: reports is too old to place by (free KV then counts only what gateways have in flight)
    state_stale: bool = False
    in_flight_at_scrape: int = 0
    in_flight_tokens_at_scrape: int = 0
    in_flight: int = 0
    in_flight_tokens: int = 0
    #: the other gateway replicas' requests on the engine as last exchanged through the state
    #: store (:mod:`gateway.state.replica_load`): how many, their reserved tokens (prompt and
    #: output budget) and their running tokens; all zero where this gateway is the only one
    remote_in_flight: int = 0
    remote_tokens: int = 0
    remote_running_tokens: int = 0
    #: the first two as of the last scrape: what of theirs the engine's report holds
    remote_at_scrape: int = 0
    remote_tokens_at_scrape: int = 0
    last_error: str = ""
    running: dict[str, RunningEntry] = field(default_factory=dict)
    #: prompt tokens of running requests whose first token has not come yet (less what the
    #: dispatcher expected cached there), by request id
    unprefilled: dict[str, int] = field(default_factory=dict)
    #: prompt tokens each running request was expected to find here in blocks that other running
    #: requests use (they take no new KV), by request id, when any
    shared: dict[str, int] = field(default_factory=dict)
    #: sum over running requests of prompt tokens + tokens generated so far (the decode batch's
    #: current length), kept as requests come, stream and go
    running_tokens: int = 0
    #: taken out of rotation for an admin action (a role flip): healthy, but given no new work
    draining: bool = False
    #: a role change failed and so did telling the engine its old role again: which of the two
    #: it runs is unknown, so it stays out of rotation (draining) until a role flip succeeds
    role_unsure: bool = False
    #: the role a flip under way is moving the engine to (None: no flip): it may end in that
    #: role, keep its old one, or neither, so other flips' checks rely on it for nothing
    role_target: Role | None = None
    #: out of rotation while it holds work and makes no progress (:func:`policies.stall.is_stalled`)
    stalled: bool = False
    #: out of rotation for a while after failed requests in a row (:mod:`gateway.serving.outliers`)
    tripped: bool = False
    #: a count that moves with every sign of progress (first tokens, streamed events, the
    #: engine's own work counters): read by the stall check, cheap on the relay's path
    progress: int = 0
    #: reservations made on the engine so far (what came there meanwhile, between two reads)
    reservations: int = 0
    #: the count at the last stall check, and when it last moved as of a check
    progress_seen: int = 0
    progress_at: float = 0.0
    #: running requests per TPOT target (a handful of SLO classes: the tightest is a min over few)
    tpot_counts: dict[float, int] = field(default_factory=dict)
    #: LoRA adapters loaded on the engine's model, as its ``/v1/models`` listed them last
    adapters: frozenset[str] = frozenset()
    #: the context length its model list gives for its model (None: not given, or not read yet)
    max_model_len: int | None = None
    #: why the engine's model list, as last read, shows it does not serve its configured model
    #: ("" when it does, or the list cannot tell): it is kept out of rotation while so
    unlisted: str = ""
    #: output tokens per streamed content event, from finished streams' usage (more than one on
    #: engines that send several tokens an event: speculative decoding, vLLM --stream-interval)
    tokens_per_event: float = 1.0
    #: when the scrape whose state this is was sent
    scrape_sent_at: float = 0.0
    #: the latest health checks' round trips (seconds): the path to the engine and back, the
    #: gateway's own lateness in reading the answer included (see :meth:`Fleet.path_delay`)
    round_trips: deque[float] = field(default_factory=lambda: deque(maxlen=ROUND_TRIPS_KEPT))
    #: what of the adapter's configuration never changes, held here: every placement, release and
    #: snapshot reads it, and the hops through the adapter and its configuration were cache misses
    #: on each (the dispatch loop runs cold between events, on memory the streams have used)
    engine_id: str = field(init=False)
    model: str = field(init=False)
    weight: float = field(init=False)
    accepts_priority: bool = field(init=False)

    def __post_init__(self) -> None:
        adapter = self.adapter
        self.engine_id = adapter.engine_id
        self.model = adapter.config.model
        self.weight = adapter.config.weight
        self.accepts_priority = adapter.accepts_priority

    def note_tokens_per_event(self, completion_tokens: int, events: int) -> None:
        """A stream ended with its usage: fold its tokens per content event into the estimate."""
        if events > 0 and completion_tokens > 0:
            ratio = min(MAX_TOKENS_PER_EVENT, max(1.0, completion_tokens / events))
            self.tokens_per_event += 0.2 * (ratio - self.tokens_per_event)

    def tightest_tpot(self) -> float | None:
        """The tightest TPOT target among the requests running here (None: none runs)."""
        counts = self.tpot_counts
        return min(counts) if counts else None

    def free_kv_tokens(self) -> int | None:
        """KV tokens the engine can still take, as well as the gateway can tell; ``None`` when the
        engine publishes no KV capacity.

        Like :func:`policies.api.estimated_load`: the engine's reported use already holds what this
        gateway had in flight when it was scraped; replace that with what it has in flight now, so
        placements and completions since the scrape count at once (a request's whole budget,
        prompt and output, is reserved for it).
        """
        state = self.state
        if state is None or not state.num_gpu_blocks or not state.block_size:
            return None
        capacity = state.num_gpu_blocks * state.block_size
        tokens = self.in_flight_tokens + self.remote_tokens
        if self.state_stale:
            # (a busy engine's slow /metrics kept its last, high, reading in every placement: the
            # engine parked as full for as long as its scrapes failed)
            return max(0, capacity - tokens)
        reported = int(capacity * state.kv_usage)
        used = max(tokens, reported - self.in_flight_tokens_at_scrape - self.remote_tokens_at_scrape + tokens)
        return max(0, capacity - used)

    def counts_steps(self, now: float, within_s: float) -> bool:
        """Whether a non-streamed request here shows its progress: the engine publishes a step
        counter, read less than ``within_s`` ago. Without one (an OpenAI-compatible server,
        SGLang) such a request says nothing until it ends; nor while its scrapes fail (a busy
        engine's slow /metrics is no stall)."""
        timing = None if self.state is None else self.state.timing
        return timing is not None and timing.steps is not None and now - self.state_at < within_s

    def seats_taken(self) -> int:
        """Requests on the engine from every gateway replica (this one's, the others' as last
        exchanged): what ``max_engine_load`` bounds."""
        return len(self.running) + self.remote_in_flight


#: the roles that take a request from the admission queue: a collocated engine serves it whole, a
#: prefill engine serves its prefill stage; decode engines are placed on by the decode stage
FRONT_ROLES = frozenset((Role.COLLOCATED, Role.PREFILL))

#: called with (engine id, what changed): "release", "prefilled", "state", "health", "role",
#: "adapters" (the LoRA adapters it has loaded), "remote" (other replicas' requests there ended)
ChangeListener = Callable[[str, str], None]


class TokenObserver(Protocol):
    """Sees every streamed token as it arrives (the latency learner)."""

    def tokens(self, record: EngineRecord, entry: RunningEntry, tokens: int) -> None: ...


#: the most requests, blocks or tokens per block an engine's report is believed: a broken or
#: hostile engine may report any number, and one past what a float holds made every later
#: snapshot of every model raise
MAX_REPORTED = 1 << 31


def _worked(before: EngineState | None, after: EngineState | None) -> bool:
    """Whether the engine's own work counters moved between two scrapes (progress that no
    stream of this gateway shows: non-streamed answers, other clients' requests)."""
    old = None if before is None else before.timing
    new = None if after is None else after.timing
    if old is None or new is None:
        return False
    return any(
        b is not None and a is not None and b > a
        for a, b in (
            (old.steps, new.steps),
            (old.prompt_tokens, new.prompt_tokens),
            (old.generation_tokens, new.generation_tokens),
        )
    )


def bounded_state(state: EngineState) -> EngineState:
    """``state`` with what no engine can report brought within bounds: counts in
    [0, MAX_REPORTED], KV use in [0, 1], block figures positive and bounded or unknown, counters
    finite and non-negative. The same object when nothing needed it (the usual case)."""
    kv = state.kv_usage
    bounded = replace(
        state,
        num_running=min(max(state.num_running, 0), MAX_REPORTED),
        num_waiting=min(max(state.num_waiting, 0), MAX_REPORTED),
        kv_usage=min(max(kv, 0.0), 1.0) if math.isfinite(kv) else 0.0,
        prefix_queries=_counter(state.prefix_queries),
        prefix_hits=_counter(state.prefix_hits),
        block_size=_block(state.block_size),
        num_gpu_blocks=_block(state.num_gpu_blocks),
    )
    return state if bounded == state else bounded


def alone_since(record: EngineRecord) -> int:
    """The engine's reservation count if the request just reserved there is its only one (what a
    later read compares to see that none came since), else -1."""
    return record.reservations if record.seats_taken() == 1 else -1


def _counter(value: float) -> float:
    return value if math.isfinite(value) and value >= 0.0 else 0.0


def _block(value: int | None) -> int | None:
    return value if value is not None and 0 < value <= MAX_REPORTED else None


#: how late another replica's news of a request may come after the request ended, as pushed
#: (push delay, the store's round trip, each loop's own lateness): news of a release heard this
#: soon after a scrape may concern a request already out of the engine's report
REMOTE_NEWS_LAG_S = 0.05


class Fleet:
    """Registry of engines keyed by engine id."""

    def __init__(self, adapters: Iterable[EngineAdapter], stale_after_s: float) -> None:
        self.records: dict[str, EngineRecord] = {}
        for index, adapter in enumerate(adapters):
            self.records[adapter.engine_id] = EngineRecord(adapter, index)
        self._by_index = list(self.records.values())
        self.stale_after_s = stale_after_s
        #: models configured on any engine; fixed for the life of the registry
        self.served_models: frozenset[str] = frozenset(r.model for r in self.records.values())
        self.engines_of: dict[str, tuple[EngineRecord, ...]] = {
            m: tuple(r for r in self._by_index if r.model == m) for m in self.served_models
        }
        #: per model, healthy engines of the front pool (see FRONT_ROLES) that are not draining
        self._healthy_per_model: dict[str, int] = dict.fromkeys(self.served_models, 0)
        #: per model, engines with the prefill role (healthy or not)
        self._prefill_engines: dict[str, int] = dict.fromkeys(self.served_models, 0)
        for record in self._by_index:
            if record.adapter.role is Role.PREFILL:
                self._prefill_engines[record.model] += 1
        self._engine_snaps: list[EngineSnapshot | None] = [None] * len(self._by_index)
        self._dirty: set[int] = set(range(len(self._by_index)))
        #: dirty engines whose key in the ranked index may be out of date too: all of them but
        #: those only reserved on or released from since, when the index ranks by load (their
        #: key was moved then; see _rank_load)
        self._unranked: set[int] = set(self._dirty)
        self._snapshot: FleetSnapshot | None = None
        self._built_at = 0.0
        #: per model, the routable engines' snapshots (healthy, collocated) in a list whose slots
        #: are patched as entries are rebuilt; its membership is redone only when health changes
        self._routable: dict[str, list[EngineSnapshot]] = {m: [] for m in self.served_models}
        #: the same engines' records, slot for slot (what the ranked choice returns)
        self._routable_records: dict[str, list[EngineRecord]] = {m: [] for m in self.served_models}
        self._routable_slot: dict[int, int] = {}
        self._routable_stale: set[str] = set(self.served_models)
        #: per model, the routable engines grouped by the router's ranking key (see rank_by)
        self._ranked: dict[str, RankIndex] = {}
        #: the ranking key is the engine's load (see rank_by)
        self._ranked_by_load = False
        self.listeners: list[ChangeListener] = []
        #: told of every streamed token before it is counted (None: nobody watches)
        self.token_observer: TokenObserver | None = None
        #: LoRA adapter -> the served model it is loaded on, over every engine (see set_adapters)
        self.adapter_bases: dict[str, str] = {}
        #: told after every reservation and release (None: nobody shares this fleet's load)
        self.load_listener: Callable[[], None] | None = None

    # -- reads -----------------------------------------------------------------------------------

    def models(self) -> set[str]:
        return set(self.served_models)

    def healthy_models(self) -> set[str]:
        return {m for m, n in self._healthy_per_model.items() if n}

    def adapter_in_rotation(self, name: str) -> bool:
        """Whether an engine in rotation (front pool) has LoRA adapter ``name`` loaded and, when
        only prefill engines of a model served disaggregated have it, a decode engine in rotation
        has it too (its requests decode there: prefilled on an engine that has it, they got a
        decode engine's 404). O(engines of its model); asked only for requests that name an
        adapter."""
        base = self.adapter_bases.get(name) or ""
        holders = [r for r in self.engines_of.get(base, ()) if name in r.adapters and self.in_front(r)]
        if not holders:
            return False
        if not self.has_prefill_pool(base) or any(r.adapter.role is Role.COLLOCATED for r in holders):
            return True  # (a collocated engine that has it serves it whole)
        return any(name in e.adapters for e in self.decode_pool(base))

    def adapter_base(self, name: str) -> str | None:
        """The served model whose engines have LoRA adapter ``name`` loaded (None: no engine lists
        it). A configured model's name is never an adapter."""
        return self.adapter_bases.get(name)

    def has_healthy(self, model: str) -> bool:
        """O(1): whether any engine that takes ``model``'s queued requests (collocated or
        prefill) is in rotation."""
        return self._healthy_per_model.get(model, 0) > 0

    def has_prefill_pool(self, model: str) -> bool:
        """O(1): whether ``model`` is served disaggregated (some engine of it is a prefill one)."""
        return self._prefill_engines.get(model, 0) > 0

    def decode_pool(self, model: str, now: float | None = None) -> list[EngineSnapshot]:
        """Healthy decode engines of ``model`` neither draining nor stalled, in fleet order
        (O(engines of the model); the decode stage runs once per disaggregated request, not per
        queue event)."""
        if self._dirty:
            self._rebuild_dirty(now)
        pool: list[EngineSnapshot] = []
        for record in self.engines_of.get(model, ()):
            snap = self._engine_snaps[record.index]
            if snap is not None and snap.healthy and self.in_decode_pool(record):
                pool.append(snap)
        return pool

    def snapshot(self, now: float | None = None) -> FleetSnapshot:
        """Immutable view for policies; only engines changed since the last one are rebuilt.

        Staleness is evaluated when an engine's entry is rebuilt; the monitor marks each engine
        changed on every check, so an entry is never more stale than one monitor interval.
        """
        if self._dirty:
            self._rebuild_dirty(now)
        if self._snapshot is None:
            self._snapshot = FleetSnapshot(tuple(self._engine_snaps), self._built_at)  # type: ignore[arg-type]
        return self._snapshot

    def _rebuild_dirty(self, now: float | None) -> None:
        # the fleet-wide tuple is made only when someone asks for it: placements read the
        # patched per-model lists and would otherwise copy every engine on every reservation
        now = time.monotonic() if now is None else now
        snaps = self._engine_snaps
        slots = self._routable_slot
        for index in self._dirty:
            record = self._by_index[index]
            snap = snaps[index] = self._build(record, now)
            slot = slots.get(index)
            if slot is not None:
                self._routable[record.model][slot] = snap
                ranked = self._ranked.get(record.model)
                if ranked is not None and record.model not in self._routable_stale:
                    ranked.update(slot, snap)  # (a stale model's index is rebuilt on its next read)
        self._dirty.clear()
        self._unranked.clear()
        self._snapshot = None
        self._built_at = now

    def candidates(self, model: str, now: float | None = None) -> tuple[EngineSnapshot, ...]:
        """Healthy engines of ``model``'s front pool (collocated or prefill, not draining), as
        snapshot entries: O(1) in Python (a
        copy of a patched list) unless health changed since the last call."""
        return tuple(self._routable_of(model, now))

    def rank_by(self, key: RankKey, by_load: bool = False) -> None:
        """Keep every model's routable engines grouped by ``key`` from now on (see
        :meth:`least_ranked`); costs O(log engines) per snapshot entry rebuilt. ``by_load``: the
        key is the entry's ``load`` (:func:`policies.api.estimated_load`); a reservation or a
        release then moves the engine in the index at once, from its record, and its snapshot
        entry is rebuilt only when something reads it (a placement made none)."""
        self._ranked = {m: RankIndex(key) for m in self.served_models}
        self._ranked_by_load = by_load
        self._routable_stale.update(self.served_models)

    def least_ranked(
        self, model: str, now: float | None = None
    ) -> tuple[list[EngineRecord], list[int], float]:
        """The routable engines of ``model``, the slots among them with the smallest ranking key
        (in fleet order) and that key (empty, empty and inf when none is routable). Only after
        :meth:`rank_by`; the lists are the fleet's own: read them, never change them."""
        if self._unranked or model in self._routable_stale:
            self._routable_of(model, now)
        ranked = self._ranked.get(model)
        if ranked is None:
            raise RuntimeError(f"no ranking index for model {model!r}: call rank_by first")
        return self._routable_records[model], ranked.least(), ranked.least_key()

    def _rank_load(self, record: EngineRecord) -> None:
        """After a reservation or a release (only the engine's in-flight counts moved): move it
        in a by-load index now, from its record and its entry's staleness (re-read when the entry
        is next rebuilt, as the monitor has it at least every check); otherwise the index waits
        for the entry's rebuild."""
        index = record.index
        if not self._ranked_by_load or index in self._unranked or record.model in self._routable_stale:
            self._unranked.add(index)
            return
        slot = self._routable_slot.get(index)
        if slot is None:
            return  # not in the index (out of rotation, or a decode engine): nothing to move
        snap = self._engine_snaps[index]
        if snap is None:
            self._unranked.add(index)
            return
        load = load_of(
            record.in_flight + record.remote_in_flight,
            record.state,
            snap.stale,
            record.in_flight_at_scrape + record.remote_at_scrape,
        )
        self._ranked[record.model].move(slot, load)

    def _routable_of(self, model: str, now: float | None) -> list[EngineSnapshot]:
        if self._dirty:
            self._rebuild_dirty(now)
        if model in self._routable_stale:
            self._routable_stale.discard(model)
            routable: list[EngineSnapshot] = []
            records: list[EngineRecord] = []
            for record in self.engines_of.get(model, ()):
                self._routable_slot.pop(record.index, None)
                snap = self._engine_snaps[record.index]
                if (
                    snap is not None
                    and snap.healthy
                    and snap.role in FRONT_ROLES
                    and not record.draining
                    and not record.stalled
                    and not record.tripped
                ):
                    self._routable_slot[record.index] = len(routable)
                    routable.append(snap)
                    records.append(record)
            self._routable[model] = routable
            self._routable_records[model] = records
            ranked = self._ranked.get(model)
            if ranked is not None:
                ranked.reset(routable)
        return self._routable.get(model, [])

    def engine_snapshot(self, engine_id: str, now: float | None = None) -> EngineSnapshot:
        """One engine's current snapshot entry, rebuilt only if it changed."""
        record = self.records[engine_id]
        snap = self._engine_snaps[record.index]
        if snap is None or record.index in self._dirty:
            self._rebuild_dirty(now)
            snap = self._engine_snaps[record.index]
        assert snap is not None
        return snap

    def _build(self, r: EngineRecord, now: float) -> EngineSnapshot:
        state = r.state
        # (positional, in EngineSnapshot's field order: keywords cost a lookup each)
        return EngineSnapshot(
            r.engine_id,
            r.model,
            r.adapter.role,
            r.healthy,
            state is None or now - r.state_at > self.stale_after_s,
            r.weight,
            # (every replica's: the others' as last exchanged, zero where there are none)
            r.in_flight + r.remote_in_flight,
            r.in_flight_tokens + r.remote_tokens,
            r.in_flight_at_scrape + r.remote_at_scrape,
            state,
            r.accepts_priority,
            r.running_tokens + r.remote_running_tokens,
            r.adapters,
        )

    def touch(self, engine_id: str) -> None:
        """Rebuild this engine's snapshot entry on the next read (e.g. to re-evaluate staleness)."""
        index = self.records[engine_id].index
        self._dirty.add(index)
        self._unranked.add(index)

    def invalidate(self) -> None:
        self._dirty.update(range(len(self._by_index)))
        self._unranked.update(self._dirty)

    def _notify(self, engine_id: str, what: str) -> None:
        for listener in self.listeners:
            try:
                listener(engine_id, what)
            except Exception:  # a listener's bug must not undo the change that was made
                log.exception("fleet listener failed on %s %s", engine_id, what)

    # -- shadow state: reserved at assignment, released when the request leaves the engine --------

    def reserve(self, engine_id: str, request_id: str, entry: RunningEntry) -> None:
        """Count ``request_id`` against the engine now. Raises ``KeyError`` for a duplicate id:
        one id is one live request on one engine, never two."""
        record = self.records[engine_id]
        if request_id in record.running:
            raise KeyError(f"request {request_id!r} already holds a reservation on {engine_id}")
        shared = min(entry.shared_tokens, entry.prompt_tokens)
        if shared > 0:
            record.shared[request_id] = shared
        else:
            shared = 0
        record.in_flight += 1
        record.reservations += 1
        record.in_flight_tokens += entry.prompt_tokens - shared + entry.max_tokens
        record.running[request_id] = entry
        record.running_tokens += entry.prompt_tokens + entry.generated
        record.tpot_counts[entry.tpot_slo] = record.tpot_counts.get(entry.tpot_slo, 0) + 1
        if not entry.prefilled:
            record.unprefilled[request_id] = entry.prompt_tokens - min(
                max(entry.cached_tokens, 0), entry.prompt_tokens
            )
        self._dirty.add(record.index)
        self._rank_load(record)
        if self.load_listener is not None:
            self.load_listener()

    def release(self, engine_id: str, request_id: str) -> RunningEntry | None:
        """Undo :meth:`reserve`; idempotent (a second release of the same id does nothing)."""
        record = self.records[engine_id]
        entry = record.running.pop(request_id, None)
        if entry is not None:
            record.in_flight -= 1
            shared = record.shared.pop(request_id, 0) if record.shared else 0
            record.in_flight_tokens -= entry.prompt_tokens - shared + entry.max_tokens
            record.running_tokens -= entry.prompt_tokens + entry.generated
            record.unprefilled.pop(request_id, None)
            left = record.tpot_counts[entry.tpot_slo] - 1
            if left:
                record.tpot_counts[entry.tpot_slo] = left
            else:
                del record.tpot_counts[entry.tpot_slo]
            self._dirty.add(record.index)
            self._rank_load(record)
            if self.load_listener is not None:
                self.load_listener()
            self._notify(engine_id, "release")
        return entry

    def update_remote(self, loads: Mapping[str, tuple[int, int, int]], now: float) -> None:
        """The other gateway replicas' requests on the engines named, as just heard (count,
        reserved tokens, running tokens); engines this fleet does not know are skipped. An engine
        where theirs went down is announced (``"remote"``): a request queued here may fit there
        now."""
        records = self.records
        for engine_id, (count, tokens, running) in loads.items():
            record = records.get(engine_id)
            if record is None or (
                count == record.remote_in_flight
                and tokens == record.remote_tokens
                and running == record.remote_running_tokens
            ):
                continue
            fell = count < record.remote_in_flight or tokens < record.remote_tokens
            record.remote_in_flight, record.remote_tokens = count, tokens
            record.remote_running_tokens = running
            if now - record.state_at <= REMOTE_NEWS_LAG_S:
                # theirs that ended just as the engine rendered its report, heard only after it,
                # may be out of it already: no more of theirs is subtracted than they have now,
                # erring towards counting twice (for longer, a release is one after the report:
                # clamping on every one undercounted nothing but overcounted all of them)
                record.remote_at_scrape = min(record.remote_at_scrape, count)
                record.remote_tokens_at_scrape = min(record.remote_tokens_at_scrape, tokens)
            self._dirty.add(record.index)
            self._rank_load(record)
            if fell:
                self._notify(record.engine_id, "remote")

    def mark_prefilled(self, engine_id: str, request_id: str) -> None:
        """The request's first token arrived: its prompt no longer waits for prefill there."""
        record = self.records[engine_id]
        entry = record.running.get(request_id)
        if entry is None or entry.prefilled:
            return
        entry.prefilled = True
        record.progress += 1
        record.unprefilled.pop(request_id, None)
        if entry.on_prefilled is not None:
            callback, entry.on_prefilled = entry.on_prefilled, None
            try:
                callback()
            except Exception:  # the caller's bug must not stop the relay that reported the token
                log.exception("on_prefilled callback of %s failed", request_id)
        self._notify(engine_id, "prefilled")

    def add_generated(self, record: EngineRecord, entry: RunningEntry, tokens: int) -> None:
        """``tokens`` more were streamed for ``entry`` (a running request of ``record``)."""
        observer = self.token_observer
        if observer is not None:
            observer.tokens(record, entry, tokens)
        entry.generated += tokens
        record.running_tokens += tokens
        record.progress += tokens

    # -- health and state, written by the monitor and by data-path failures -----------------------

    def record_state(
        self,
        engine_id: str,
        state: EngineState | None,
        now: float,
        sent_at: float | None = None,
        in_flight_at_send: tuple[int, int] | None = None,
        remote_at_send: tuple[int, int] | None = None,
    ) -> None:
        """The engine's state as a scrape read it at ``now``; ``sent_at``: when the scrape was
        sent, with what was in flight then. The engine rendered its metrics somewhere between,
        so what was placed meanwhile may or may not be in its report. Subtracted as if it were,
        it hid as much of the engine's other load until the next scrape; so the in-flight counts
        are the lesser of the two, erring towards counting a placement twice (more load, for one
        scrape interval) rather than other load not at all."""
        record = self.records[engine_id]
        before = record.state
        record.state = None if state is None else bounded_state(state)
        if _worked(before, record.state):
            record.progress += 1
        record.state_at = now
        record.state_stale = False
        record.scrape_sent_at = now if sent_at is None else sent_at
        in_flight, tokens = record.in_flight, record.in_flight_tokens
        if in_flight_at_send is not None:
            in_flight, tokens = min(in_flight, in_flight_at_send[0]), min(tokens, in_flight_at_send[1])
        record.in_flight_at_scrape = in_flight
        record.in_flight_tokens_at_scrape = tokens
        # (the other replicas' likewise: what they had at the send, if less than now)
        remote, remote_tokens = record.remote_in_flight, record.remote_tokens
        if remote_at_send is not None:
            remote, remote_tokens = min(remote, remote_at_send[0]), min(remote_tokens, remote_at_send[1])
        record.remote_at_scrape = remote
        record.remote_tokens_at_scrape = remote_tokens
        self._dirty.add(record.index)
        self._unranked.add(record.index)
        self._notify(engine_id, "state")

    def scrape_failed(self, engine_id: str, now: float) -> None:
        """A scrape of the engine failed at ``now``: once its last reading is older than
        ``stale_after_s``, placements stop reading its KV use (:meth:`EngineRecord.free_kv_tokens`),
        as snapshots stop reading its load."""
        record = self.records[engine_id]
        if record.state is None or record.state_stale or now - record.state_at <= self.stale_after_s:
            return
        record.state_stale = True
        self._dirty.add(record.index)
        self._unranked.add(record.index)
        self._notify(engine_id, "state")  # (KV it was thought to lack may be free: a look)

    def set_adapters(self, engine_id: str, adapters: frozenset[str]) -> bool:
        """The LoRA adapters the engine has loaded now (the monitor's read of its ``/v1/models``);
        returns True when they changed. Kept while the engine is ejected or the read fails: an
        engine's adapters change only when it says so (or restarts, which its next read shows)."""
        record = self.records[engine_id]
        adapters = adapters - self.served_models  # a configured model's name is never an adapter
        if adapters == record.adapters:
            return False
        record.adapters = adapters
        bases: dict[str, str] = {}
        for other in self._by_index:
            for name in sorted(other.adapters):
                base = bases.setdefault(name, other.model)
                if base != other.model:
                    log.warning(
                        "LoRA adapter %r is loaded on engines of models %r and %r; requests for it go to %r",
                        name,
                        base,
                        other.model,
                        base,
                    )
        self.adapter_bases = bases
        self._dirty.add(record.index)
        self._unranked.add(record.index)
        self._restore_needed(record.model)  # (an adapter unloaded: a stalled engine may hold the last)
        self._notify(engine_id, "adapters")
        return True

    @staticmethod
    def in_front(record: EngineRecord) -> bool:
        return (
            record.healthy
            and not record.draining
            and not record.stalled
            and not record.tripped
            and record.adapter.role in FRONT_ROLES
        )

    @staticmethod
    def in_decode_pool(record: EngineRecord) -> bool:
        return (
            record.healthy
            and not record.draining
            and not record.stalled
            and not record.tripped
            and record.adapter.role is Role.DECODE
        )

    def _in_rotation(self, record: EngineRecord) -> bool:
        """In rotation in its own pool: the front one (collocated and prefill) or the decode one."""
        return self.in_decode_pool(record) if record.adapter.role is Role.DECODE else self.in_front(record)

    def peers(self, record: EngineRecord) -> list[EngineRecord]:
        """The other engines of its model in rotation in its pool."""
        decode = record.adapter.role is Role.DECODE
        return [
            other
            for other in self.engines_of.get(record.model, ())
            if other is not record
            and (other.adapter.role is Role.DECODE) == decode
            and self._in_rotation(other)
        ]

    def _set_healthy(self, record: EngineRecord, healthy: bool) -> None:
        if record.healthy == healthy:
            return
        before = self.in_front(record)
        record.healthy = healthy
        self._membership_changed(record, before)
        self._notify(record.engine_id, "health")

    def _membership_changed(self, record: EngineRecord, was_in_front: bool) -> None:
        now_in_front = self.in_front(record)
        if now_in_front != was_in_front:
            self._healthy_per_model[record.model] += 1 if now_in_front else -1
        self._routable_stale.add(record.model)
        self._dirty.add(record.index)
        self._unranked.add(record.index)
        self._restore_needed(record.model)

    def _restore_needed(self, model: str) -> None:
        """A stall (or an outlier ejection) only moves work between a pool's engines, never
        refuses it: a stalled or ejected engine comes back once no other engine of its pool in
        rotation could take its work (none left, or none with one of its LoRA adapters), as
        :meth:`check_stall` would not have marked it then (a false alarm, say one long prefill
        with nothing else to stream, would otherwise be an outage). Decided for every such
        engine before any returns."""
        engines = self.engines_of.get(model, ())
        needed = [
            other
            for other in engines
            if (other.stalled or other.tripped)
            and other.healthy
            and not other.draining
            and (not (peers := self.peers(other)) or self._sole_holder(other, peers))
        ]
        for other in needed:
            self.set_stalled(other.engine_id, False)
            self.set_tripped(other.engine_id, False)

    def set_stalled(self, engine_id: str, stalled: bool) -> None:
        """Take the engine out of rotation for a stall (see :meth:`check_stall`) or back in."""
        self._set_out(engine_id, "stalled", stalled)

    def _set_out(self, engine_id: str, flag: str, value: bool) -> None:
        """Set one of the flags that take an engine out of rotation (stalled, tripped, draining)."""
        record = self.records[engine_id]
        if getattr(record, flag) == value:
            return
        before = self.in_front(record)
        setattr(record, flag, value)
        self._membership_changed(record, before)
        self._notify(engine_id, "role")  # (as for a drain: out of rotation, or back with a fresh look)

    def set_tripped(self, engine_id: str, tripped: bool) -> None:
        """Take the engine out of rotation after failed requests in a row, or back in."""
        self._set_out(engine_id, "tripped", tripped)

    def check_stall(self, engine_id: str, now: float, after_s: float) -> bool:
        """Mark the engine stalled, or no longer, by :func:`policies.stall.is_stalled`; True when
        that changed. The last engine of its model in rotation in its pool (front, or decode) is
        never marked: it takes the work or nothing does."""
        record = self.records[engine_id]
        if record.progress != record.progress_seen:
            record.progress_seen = record.progress
            record.progress_at = now
        state = record.state
        counted = record.counts_steps(now, after_s)
        sent = [
            max(e.dispatched_at, e.ready_at)
            for e in record.running.values()
            if e.dispatched_at > 0.0 and (counted or e.stream)
        ]
        oldest = min(sent) if sent else None
        if oldest == math.inf:
            oldest = None  # (all it holds waits for KV from prefills still running elsewhere)
        if (
            state is not None
            and now - record.state_at < after_s
            and state.num_running == 0
            and state.num_waiting == 0
        ):
            # the engine has nothing to do: what it holds for this gateway waits on the gateway's
            # side (a client that reads slowly holds its stream's last events), not on the engine
            oldest = None
        stalled = is_stalled(oldest, record.progress_at, now, after_s)
        if stalled == record.stalled:
            return False
        if stalled:
            if not self._in_rotation(record):
                return False  # (ejected or drained already)
            peers = self.peers(record)
            if not peers or self._sole_holder(record, peers):
                return False  # (the last one, or the last with an adapter: see above)
        self.set_stalled(engine_id, stalled)
        return True

    @staticmethod
    def _sole_holder(record: EngineRecord, peers: list[EngineRecord]) -> bool:
        """Whether the engine is the only one of its pool in rotation (``peers`` are the others)
        with one of its LoRA adapters loaded: out of rotation, that adapter's requests would be
        refused, not moved."""
        return any(not any(name in o.adapters for o in peers) for name in record.adapters)

    def set_draining(self, engine_id: str, draining: bool) -> None:
        """Take the engine out of rotation (no new work; what runs there finishes) or back in."""
        self._set_out(engine_id, "draining", draining)

    def set_role(self, engine_id: str, role: Role) -> None:
        """The engine now serves as ``role`` (after the admin flip drained it)."""
        record = self.records[engine_id]
        if record.adapter.role is role:
            return
        before = self.in_front(record)
        self._prefill_engines[record.model] += (role is Role.PREFILL) - (record.adapter.role is Role.PREFILL)
        record.adapter.role = role
        self._membership_changed(record, before)
        self._notify(engine_id, "role")

    def record_round_trip(self, engine_id: str, seconds: float) -> None:
        """A request to the engine that does next to no work there (its health route) came back
        after ``seconds``."""
        if seconds >= 0.0 and math.isfinite(seconds):
            self.records[engine_id].round_trips.append(seconds)

    def path_delay(self, engine_id: str) -> float:
        """How long a request takes to reach the engine and its answer to come back, as far as
        the gateway can tell: the least of the latest health checks' round trips (a check held
        up by something else says nothing of the path), 0 before the first."""
        trips = self.records[engine_id].round_trips
        return min(trips) if trips else 0.0

    def record_health(
        self, engine_id: str, ok: bool, eject_after: int, readmit_after: int, error: str = ""
    ) -> bool:
        """Update consecutive counters; returns True when the healthy flag flipped."""
        record = self.records[engine_id]
        before = record.healthy
        if ok:
            record.consecutive_failures = 0
            record.consecutive_successes += 1
            if not record.healthy and record.consecutive_successes >= readmit_after:
                self._set_healthy(record, True)
        else:
            record.consecutive_successes = 0
            record.consecutive_failures += 1
            record.last_error = error
            if record.healthy and record.consecutive_failures >= eject_after:
                self._set_healthy(record, False)
        return record.healthy != before

    def eject(self, engine_id: str, error: str) -> None:
        """The data path could not connect: take the engine out at once; the monitor re-admits it."""
        record = self.records[engine_id]
        record.consecutive_successes = 0
        record.last_error = error
        self._set_healthy(record, False)
