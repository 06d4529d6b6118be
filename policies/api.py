"""The policy API: the only module plugin authors import.

Policies are pure, synchronous functions over snapshots they only read (``EngineSnapshot`` is
read-only by contract, not frozen; the rest are frozen). They never do I/O, never touch
asyncio, and never import from ``gateway``. The live gateway and the offline simulator build the
same snapshots and call the same policies, so a decision made in an experiment is the decision the
gateway would make.

Time is always passed in (``now``, seconds on a monotonic clock chosen by the caller) and any
memory a policy needs is explicit state that it returns, never hidden module globals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


class Role(StrEnum):
    """What an engine does in the serving pipeline."""

    COLLOCATED = "collocated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class EngineTiming:
    """The engine's own account of the work it did, cumulative since it started (``None``: the
    engine does not export that figure). Differences between two scrapes describe the interval.

    ``steps``: engine steps that produced output, and ``step_tokens`` the tokens they carried
    (vLLM: ``iteration_tokens_total``; llama.cpp: ``n_decode_total``, no token sum);
    ``prompt_tokens`` / ``generation_tokens``: tokens processed; ``preemptions``: requests sent
    back to waiting. ``finished``: requests whose timings are summed in ``queue_s`` (waiting in
    the engine), ``prefill_s`` (scheduled to first token) and ``decode_s`` (first to last token);
    vLLM sums them per finished request, SGLang only the queue time. llama.cpp's
    ``prompt_seconds_total`` / ``tokens_predicted_seconds_total`` are per-slot processing times
    summed as their prompts and generations end: reported as ``prefill_s`` and ``decode_s`` with
    ``finished`` unknown.
    """

    steps: float | None = None
    step_tokens: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    preemptions: float | None = None
    finished: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineState:
    """What an engine reported about itself at its last scrape.

    Counts are requests; ``kv_usage`` is the fraction of KV blocks in use (0..1); prefix counters
    are cumulative tokens since engine start. ``block_size`` and ``num_gpu_blocks`` are ``None``
    when the engine does not publish them.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    sleeping: bool = False
    #: the engine's timing and work counters, where it exports them (latency learning)
    timing: EngineTiming | None = None


@dataclass(slots=True)
class EngineSnapshot:
    """One engine as the dispatcher sees it at one instant.

    ``in_flight`` counts requests this gateway has dispatched to the engine and not yet seen
    finish (updated immediately on dispatch, unlike ``state``). ``in_flight_at_scrape`` is what
    ``in_flight`` was when ``state`` was scraped, so the two can be combined without counting the
    same request twice (see :func:`estimated_load`). ``state`` is ``None`` for engines that
    publish no metrics or have not been scraped yet; ``stale`` means it is older than the
    monitor's staleness limit.

    Read-only by contract, not frozen: the fleet makes a new entry on every reservation, release,
    first token and scrape and shares it with every later placement, and a frozen dataclass cost
    2.3x as much to make (tests/policies/test_snapshots_read_only.py holds policies to reading).
    """

    engine_id: str
    model: str
    role: Role = Role.COLLOCATED
    healthy: bool = True
    stale: bool = False
    weight: float = 1.0
    in_flight: int = 0
    in_flight_tokens: int = 0
    in_flight_at_scrape: int = 0
    state: EngineState | None = None
    accepts_priority: bool = False
    #: prompt + generated-so-far tokens of this gateway's requests on the engine (Gimbal's running
    #: load); refreshed whenever the entry is rebuilt (reservation, release, first token, scrape)
    running_tokens: int = 0
    #: LoRA adapters the engine has loaded on its model (from its ``/v1/models``: the cards whose
    #: ``parent`` is the model), as of the monitor's last read; empty when it lists none
    adapters: frozenset[str] = frozenset()
    #: :func:`estimated_load` of this snapshot, computed once when it is made (scorers read it for
    #: every engine on every placement)
    load: float = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self.load = estimated_load(self)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """All engines at one instant; ``taken_at`` is the caller's monotonic clock in seconds."""

    engines: tuple[EngineSnapshot, ...]
    taken_at: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of the request's prompt each engine already holds in its prefix cache, as the
    gateway's prefix index knows it at the moment of routing.

    ``prompt_tokens``: tokens that were hashed (the whole prompt as the engine's chat template
    renders it, exact, unlike ``RequestView.prompt_tokens``); ``cached_tokens``: engine id ->
    leading prompt tokens cached there (whole blocks; an engine absent holds none).
    """

    prompt_tokens: int
    cached_tokens: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Affinity:
    """The session a request belongs to, for session affinity.

    ``key``: from ``x-session-id``, else the body's ``user``, else the API key (never the key
    itself: its fingerprint). ``engine_id``: where this session's last request was sent, if that
    was within the affinity TTL (the router fills it from its affinity store and records every
    choice back, as Gimbal's Algorithm 1 updates its user-engine map).
    """

    key: str
    engine_id: str | None = None


@dataclass(frozen=True, slots=True)
class RequestView:
    """What routing knows about a request: never the body itself.

    ``prompt_tokens`` is the gateway's estimate; ``max_output_tokens`` is the client's bound
    (or the gateway default). ``arrival`` is on the same clock as ``FleetSnapshot.taken_at``.
    ``prefix`` and ``affinity`` are filled by the router when a prefix index / affinity store is
    configured and the front door gave it the request's prompt blocks / session key; ``None``
    otherwise, and every scorer must then treat the engines alike. ``lora``: the LoRA adapter the
    request names (its body's ``model``; ``model`` is then the adapter's base model), ``None``
    for a request to the base model itself. ``engine``: the only engine that may serve it (a
    Responses API request continuing a response that engine stored), ``None`` for any.
    """

    request_id: str
    model: str
    prompt_tokens: int
    max_output_tokens: int
    arrival: float = 0.0
    tenant: str = "default"
    task: str | None = None
    priority: int = 0
    prefix: PrefixMatch | None = None
    affinity: Affinity | None = None
    lora: str | None = None
    engine: str | None = None


def estimated_load(engine: EngineSnapshot) -> float:
    """Requests queued or running on the engine now, as well as this gateway can tell.

    The engine's own count (running + waiting) already includes the requests this gateway had in
    flight when it was scraped; replace those with the current shadow count so dispatches made
    since the scrape are visible at once. Falls back to the shadow count without fresh metrics.
    """
    return load_of(engine.in_flight, engine.state, engine.stale, engine.in_flight_at_scrape)


def load_of(in_flight: int, state: EngineState | None, stale: bool, in_flight_at_scrape: int) -> float:
    """:func:`estimated_load` from its parts (what a snapshot entry holds of them)."""
    if state is None or stale:
        return float(in_flight)
    reported = state.num_running + state.num_waiting
    return float(max(in_flight, reported - in_flight_at_scrape + in_flight))


@runtime_checkable
class Filter(Protocol):
    """Drops engines that must not take the request. Returning no engine is allowed."""

    def filter(
        self, request: RequestView, engines: Sequence[EngineSnapshot], now: float
    ) -> Sequence[EngineSnapshot]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores every candidate in [0, 1], higher is better; one score per engine, same order."""

    def score(
        self, request: RequestView, engines: Sequence[EngineSnapshot], now: float
    ) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses one engine from scored candidates, threading its own explicit state.

    ``state`` is whatever ``initial_state`` returned the first time and ``pick`` returned since;
    the caller stores it and passes it back. Candidates are never empty.
    """

    def initial_state(self) -> object: ...

    def pick(
        self,
        request: RequestView,
        engines: Sequence[EngineSnapshot],
        scores: Sequence[float],
        state: object,
    ) -> tuple[EngineSnapshot, object]: ...


class PolicyConfigError(ValueError):
    """A profile names an unknown plugin or gives it bad parameters; the message says how to fix it."""
