"""Decode-stage placement for prefill/decode disaggregation: which decode engine takes a request
whose prefill has just finished.

What it decides: one decode engine for one request, at the moment its prefill completes (the
second stage of two-stage P/D dispatch, HyperFlexis §5.1: the Dispatcher places the prefill, the
Migrator places the decode later, with the fleet's state of that moment, instead of fixing the pair
when the request arrives).

From what: the request's :class:`DecodeDemand` (prompt tokens whose KV moves, output bound, TPOT
target) and, per candidate engine, its snapshot (``in_flight`` requests and their
``running_tokens``: the decode batch the request would join), its latency coefficients, the KV
transfers into it that have not finished (the load on its ingress link) and its free KV room.

How (Kairos §3.2, slack between the TPOT target and the decode step time): for every candidate

* the decode step it would run after admitting the request, HyperFlexis eq.(2)
  (:func:`policies.latency.decode_step_time`) over the batch it holds now plus this request:
  ``B = in_flight + 1`` sequences of ``running_tokens + prompt_tokens`` context tokens in total;
* the transfer time of the request's KV over the candidate's ingress link, shared with the
  transfers already in flight there: ``latency + prompt_tokens / speed * (transfers_in_flight + 1)``
  (with ``n`` transfers sharing the link fairly, each moves at ``1/(n+1)`` of its speed; with a
  serial link, the request waits for ``n`` transfers of about its own size: the same figure);
* Kairos eq.(2)'s slack at the first decode step (``N = 0``, the prefill's end as the origin):
  ``slack = TPOT - transfer - step``, the time the first decoded token has to spare.

An engine is *feasible* when its predicted step meets the request's TPOT target and the tightest
TPOT target of the streams already decoding there (a loose request must not push a tight stream
past its target: without this check a fast engine was filled until its tight streams missed), the decode batch
stays within the decode token budget (``max_decode_batch_tokens``: context tokens of one decode
step, the ``sum(l_cur)`` of eq.(2), when the profile sets one) and its KV room holds the prompt and
the whole output (``prompt + max_output``; unknown room counts as enough). Among feasible engines
the one with the fewest requests and transfers wins, then the most slack (``prefer: least_load``,
the default), so load spreads over the pool instead of piling on one engine (the one-worker bug of
peer P/D routers) and no engine is starved because its latency model is still a pessimistic prior
(dynamo#7836); ``prefer: most_slack`` ranks by slack alone (better with decode engines of unequal
speed), ``prefer: best_fit`` takes the least slack, so loose requests fill slow or busy engines and
leave the fast ones' headroom to tight requests (bin packing by TPOT).
An engine whose decode model has learnt nothing yet (its prior alone) is judged by the fastest
model the pool has learnt (:func:`judged_decode`): its prior may be pessimistic, and an engine
judged infeasible by it would never decode, so never learn (feasibility ranks before load).
When no engine is feasible the least bad one is chosen: first any engine whose KV holds the
request, then the most slack; without any KV fit, the smallest KV shortfall. ``None`` only when
there is no candidate at all. Ties go to the earlier candidate (fleet order), so the choice is
deterministic.

Pure: no I/O, no clock, no imports from ``gateway``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from policies.api import EngineSnapshot
from policies.latency import LatencyCoefficients
from policies.latency_fit import Coeffs


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """One decode engine as the decode stage sees it (healthy, role DECODE or COLLOCATED)."""

    engine: EngineSnapshot
    #: the engine's latency model (eq.(1)/(2) coefficients)
    coefficients: LatencyCoefficients
    #: KV transfers into this engine not yet finished (its ingress link's load)
    transfers_in_flight: int = 0
    #: KV room in tokens (None: unknown)
    free_kv_tokens: int | None = None
    #: the tightest TPOT target among the streams already decoding there (None: none)
    tightest_running_tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class DecodeDemand:
    """The request whose prefill just finished."""

    request_id: str
    #: tokens whose KV moves to the decode engine
    prompt_tokens: int
    max_output_tokens: int
    #: the request's TPOT target, s
    tpot_s: float
    #: the prefill engine
    source_engine: str | None = None


#: how feasible decode engines are ranked (see DecodePlacementParams.prefer)
PREFER = ("most_slack", "least_load", "best_fit")


@dataclass(frozen=True, slots=True)
class DecodePlacementParams:
    #: link speed in KV tokens per second (predicts the transfer time); the default is a 7B-class
    #: model's 0.5 MB of KV per token over a 25 GB/s (200 Gb/s RDMA) link
    transfer_tokens_per_s: float = 5.0e4
    #: fixed cost of one transfer, s
    transfer_latency_s: float = 0.001
    #: the decode token budget: context tokens of one decode step, if the profile sets one
    max_decode_batch_tokens: int | None = None
    #: among feasible engines: ``least_load`` (fewest requests and transfers there, then the most
    #: slack: spreads load whatever each engine's latency model says, so an engine whose model is
    #: still the pessimistic prior is not starved of the traffic it would learn from),
    #: ``most_slack`` (the most slack against the binding TPOT: better when decode engines differ
    #: in speed, see docs/pd.md) or ``best_fit`` (the least slack: bin packing by TPOT)
    prefer: str = "least_load"

    def __post_init__(self) -> None:
        if self.prefer not in PREFER:
            raise ValueError(f"prefer must be one of {', '.join(PREFER)}, got {self.prefer!r}")


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    engine_id: str
    #: the decode step time predicted with this request added, s
    predicted_tpot_s: float
    #: the KV transfer time predicted over the engine's link, s
    predicted_transfer_s: float
    #: meets the TPOT target (and the decode token budget) and fits KV
    feasible: bool


def predicted_transfer_s(
    demand: DecodeDemand, transfers_in_flight: int, params: DecodePlacementParams
) -> float:
    """Seconds to move the request's KV over a link already carrying ``transfers_in_flight``."""
    speed = params.transfer_tokens_per_s
    per_transfer = demand.prompt_tokens / speed if speed > 0 else 0.0
    return params.transfer_latency_s + per_transfer * (max(0, transfers_in_flight) + 1)


def judged_decode(own: Coeffs, learnt: bool, pool_learnt: Sequence[Coeffs], context_tokens: int) -> Coeffs:
    """The decode coefficients a candidate is judged by: its own once it has learnt them, else
    (its prior) the pool's learnt model that predicts the fastest step for a batch of one request
    of ``context_tokens``, when one exists: an engine no faster than its prior is found out by its
    own first samples, one starved by it never would be."""
    if learnt or not pool_learnt:
        return own
    return min(pool_learnt, key=lambda c: c[0] + c[1] * context_tokens + c[2])


def predicted_step_s(candidate: DecodeCandidate, demand: DecodeDemand, joining: bool = True) -> float:
    """Eq.(2) for the candidate's decode batch with the request added (``joining=False``: the
    batch as it is).

    Eq.(2) depends only on the batch's size and its total context (a list of the batch's lengths
    cost a list as long as ``in_flight`` per candidate per placement).
    """
    engine = candidate.engine
    context = max(0, engine.running_tokens) + demand.prompt_tokens
    sequences = max(0, engine.in_flight) + (1 if joining else 0)
    if sequences == 0:
        return 0.0
    coeffs = candidate.coefficients
    return coeffs.a_d + coeffs.b_d * context + coeffs.c_d * sequences


def place_decode(
    demand: DecodeDemand, candidates: Sequence[DecodeCandidate], params: DecodePlacementParams
) -> DecodeChoice | None:
    """The decode engine for ``demand`` (see the module docstring); None only without candidates."""
    best: tuple[tuple[int, int, int, int, tuple[float, ...]], DecodeChoice] | None = None
    need = demand.prompt_tokens + demand.max_output_tokens
    for candidate in candidates:
        step = predicted_step_s(candidate, demand)
        transfer = predicted_transfer_s(demand, candidate.transfers_in_flight, params)
        room = candidate.free_kv_tokens
        shortfall = 0 if room is None else max(0, need - room)
        fits_kv = shortfall == 0
        budget = params.max_decode_batch_tokens
        within_budget = (
            budget is None or max(0, candidate.engine.running_tokens) + demand.prompt_tokens <= budget
        )
        # the step it would run must still meet every stream already decoding there, not only
        # this request's target (a loose request must not slow a tight stream past its TPOT)
        running = candidate.tightest_running_tpot_s
        binding = demand.tpot_s if running is None else min(demand.tpot_s, running)
        feasible = fits_kv and within_budget and step <= binding
        # ranked by the slack against the binding target: an engine running tight streams counts
        # as having less room, so loose requests gather where only loose streams run and the tight
        # class keeps its headroom (measured: +5 points of attainment with one decode engine 2x
        # slower, at some E2E cost when every target is met anyway; docs/pd.md)
        slack = binding - transfer - step
        if feasible and params.prefer == "best_fit":
            fit: tuple[float, ...] = (slack,)
        elif feasible and params.prefer == "least_load":
            # (a decode waiting for its KV is reserved there already: in_flight counts it)
            fit = (candidate.engine.in_flight, -slack)
        else:
            fit = (-slack,)
        # when nothing is feasible, an engine whose streams meet their TPOT now and would not with
        # this request is the last resort: overload stays confined where targets are missed
        # already (or only this request's own is), instead of spreading to every healthy engine
        breaks = (
            not feasible
            and running is not None
            and step > running
            and predicted_step_s(candidate, replace(demand, prompt_tokens=0), joining=False) <= running
        )
        # smaller is better; strict comparison keeps the earlier candidate on ties (fleet order)
        key = (0 if feasible else 1, 0 if fits_kv else 1, shortfall, 1 if breaks else 0, fit)
        if best is None or key < best[0]:
            choice = DecodeChoice(candidate.engine.engine_id, step, transfer, feasible)
            best = (key, choice)
    return None if best is None else best[1]
