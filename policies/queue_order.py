"""Admission-queue orders: pure key functions the dispatcher sorts waiting requests by.

Who calls it: :class:`policies.admission_queue.AdmissionQueue` (the gateway's dispatch loop and the
offline simulator own one) calls ``order.key(item, now, ctx)`` when a request is pushed and again
whenever the key it returned last has expired. Profiles pick an order by name through
:func:`make_order`.

Contract of ``key(item, now, ctx) -> (sort_key, valid_until)``:

* ``sort_key`` is a tuple of floats, smaller is dispatched first, and it always ends with
  ``item.seq`` so that any two queued requests compare strictly (a total order).
* The key is a *piecewise-constant* function of time: it takes the same value for every ``t`` in
  ``[now, valid_until)`` and ``valid_until > now`` (``math.inf`` if it never changes by itself).
  Because the key depends only on ``(item, t, ctx)``, the queue may recompute it at any time in a
  piece and get the same answer; each request changes key a bounded number of times (documented
  per order), so a lazily re-keyed heap stays O(log n) per operation.
* Times are seconds on the caller's monotonic clock (the same one as ``RequestView.arrival``).

Orders that use the context (``context_sensitive = True``) must be re-keyed when the estimates in
:class:`OrderContext` change; the queue does that, with a tolerance so that estimator noise does
not force a rebuild on every event.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from policies.api import PolicyConfigError, RequestView

SortKey = tuple[float, ...]
KeyResult = tuple[SortKey, float]

_INF = math.inf


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One request waiting for dispatch, as the queue orders see it.

    ``ttft_slo``/``tpot_slo`` are the request's targets in seconds. ``seq`` is the admission
    number (strictly increasing per queue) and the final tie-break of every order.
    ``queue_deadline`` is the absolute time (same clock as ``view.arrival``) at which the request
    must leave the queue whatever happens (:meth:`AdmissionQueue.expire`); ``inf`` = never.
    ``batch_deadlines`` are the absolute TTFT deadlines (same clock) of every member of the batch
    the request belongs to, its own included: the input of the MFS ``red`` order, which ranks a
    request by its batch's Robust Effective Deadline (:attr:`effective_deadline`). ``()``, the
    default, is a batch of one. Who fills it: whoever queues requests that form a batch (the
    gateway, for requests a client declares as one batch), through :func:`with_batch`, again for
    the queued members whenever a member joins; other orders ignore it.
    ``prefill_tokens_ahead`` is the prompt-token backlog queued ahead of the request when it was
    admitted (Kairos Algorithm 2); ``None`` lets the queue stamp it at push for orders that use it.
    ``flow_round`` is the request's fair-queueing round in its priority band if it is its tenant's
    head there, ``inf`` if it is parked behind it (:class:`FlowControl`); the queue stamps it at
    push and again when the request becomes or stops being the head
    (:class:`policies.flow_control.FlowRounds`); ``None``: not stamped (ranked in round 0).
    ``demoted``: given up for now under overload (:mod:`policies.demotion`); orders with
    ``uses_demotion`` (:class:`SloTpot`) rank it after every other request of its priority
    level. The dispatch core stamps it.
    """

    view: RequestView
    ttft_slo: float
    tpot_slo: float
    seq: int
    queue_deadline: float = _INF
    batch_deadlines: tuple[float, ...] = ()
    prefill_tokens_ahead: int | None = None
    flow_round: float | None = None
    demoted: bool = False

    @property
    def ttft_deadline(self) -> float:
        """Absolute time by which the first token is due: ``arrival + ttft_slo`` (seconds)."""
        return self.view.arrival + self.ttft_slo

    @property
    def effective_deadline(self) -> float:
        """MFS Robust Effective Deadline of the request's batch (absolute seconds): the same for
        every member; a request with no batch (``batch_deadlines == ()``) is its own deadline."""
        if not self.batch_deadlines:
            return self.view.arrival + self.ttft_slo
        return robust_effective_deadline(self.batch_deadlines)


@dataclass(frozen=True, slots=True)
class OrderContext:
    """Current fleet estimates that SLO-aware orders predict with.

    ``prefill_tokens_per_s``: prefill throughput of one engine (tokens/s, > 0), the online estimate
    (e.g. ``1 / b`` of the fitted latency model). ``decode_step_s``: one decode iteration (s, >= 0);
    no current order needs it, it is carried for orders that budget decode time.
    ``prefill_base_s``: constant part of a prefill's latency (s, >= 0), added to every predicted
    prefill. ``prefill_engines``: how many engines drain the queue in parallel (>= 1); the queued
    backlog ahead of a request drains at ``prefill_engines * prefill_tokens_per_s``.
    """

    prefill_tokens_per_s: float
    decode_step_s: float
    prefill_base_s: float = 0.0
    prefill_engines: int = 1
    #: what one more running sequence adds to a decode step (c' of eq.(2)), and what each token of
    #: its context adds (b'), seconds: a request's own share of the steps it decodes in
    decode_seq_s: float = 0.0
    decode_context_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError(
                f"prefill_tokens_per_s must be a finite number > 0, got {self.prefill_tokens_per_s}"
            )
        if not (self.decode_step_s >= 0 and math.isfinite(self.decode_step_s)):
            raise ValueError(f"decode_step_s must be a finite number >= 0, got {self.decode_step_s}")
        if not (self.prefill_base_s >= 0 and math.isfinite(self.prefill_base_s)):
            raise ValueError(f"prefill_base_s must be a finite number >= 0, got {self.prefill_base_s}")
        for name in ("decode_seq_s", "decode_context_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.prefill_engines < 1:
            raise ValueError(f"prefill_engines must be >= 1, got {self.prefill_engines}")

    def predicted_prefill_s(self, prompt_tokens: int) -> float:
        """Predicted prefill time of ``prompt_tokens`` on one engine, seconds (base + tokens / rate)."""
        return self.prefill_base_s + max(0, prompt_tokens) / self.prefill_tokens_per_s


def predicted_service_s(view: RequestView, ctx: OrderContext, decode_share: float = 1.0) -> float:
    """How long the request occupies an engine, predicted from its lengths: its prefill plus
    ``decode_share`` of its output bound at one decode step per token (seconds)."""
    return (
        ctx.predicted_prefill_s(view.prompt_tokens)
        + decode_share * max(0, view.max_output_tokens) * ctx.decode_step_s
    )


def marginal_service_s(view: RequestView, ctx: OrderContext) -> float:
    """The engine time the request adds, predicted from its lengths: its prefill, and per output
    token what one more sequence at its context adds to a decode step. Not a whole step per token
    (:func:`predicted_service_s`): a step's fixed cost is paid once for the whole batch, so on a
    batching engine it says little about what serving this request rather than another costs."""
    prompt = max(0, view.prompt_tokens)
    output = max(0, view.max_output_tokens)
    per_token = ctx.decode_seq_s + ctx.decode_context_s * (prompt + output / 2)
    return ctx.predicted_prefill_s(prompt) + output * per_token


def last_feasible_start(item: QueuedRequest, ctx: OrderContext) -> float:
    """The latest dispatch time at which the request's prefill still meets its TTFT deadline."""
    return item.ttft_deadline - ctx.predicted_prefill_s(item.view.prompt_tokens)


def ttft_infeasible(item: QueuedRequest, now: float, ctx: OrderContext) -> bool:
    """True when even an immediate dispatch would miss the TTFT deadline: serving it is wasted work."""
    return now > last_feasible_start(item, ctx)


class QueueOrder(Protocol):
    """A named queue order; see the module docstring for the ``key`` contract.

    ``name`` is read-only (a property here) so frozen dataclass orders satisfy the protocol.
    """

    @property
    def name(self) -> str: ...

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> tuple[tuple[float, ...], float]: ...


def _after(t: float, now: float) -> float:
    """``t`` clamped to be strictly after ``now``: guards the ``valid_until > now`` contract against
    floating-point rounding at a piece boundary (the key is then recomputed one ulp later)."""
    return t if t > now else math.nextafter(now, _INF)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_number(value: object) -> bool:
    # bool is an int subclass; ``theta_age_s: true`` in a YAML profile is a mistake, not 1 second
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _aged_level(priority: int, arrival: float, now: float, aging_s: float | None) -> tuple[float, float]:
    """The priority level a request waits at (lower goes first) and until when: with ``aging_s``,
    one level more urgent for each ``aging_s`` seconds it has waited, down to level 0 (a level
    already below 0 stays as it is). Strict levels starve the lower ones for as long as the higher
    ones keep coming; this bounds the wait of each level above 0 at ``level x aging_s`` plus what
    level 0 has queued then."""
    if aging_s is None or priority <= 0:
        return float(priority), _INF
    waited = now - arrival
    if waited >= priority * aging_s:
        return 0.0, _INF
    steps = math.floor(max(0.0, waited) / aging_s)
    return float(priority - steps), _after(arrival + (steps + 1) * aging_s, now)


#: the shortest aging period: each step re-keys the request in the queue
MIN_AGING_S = 0.1


def _check_aging(aging_s: float | None) -> None:
    _require(
        aging_s is None or (_is_number(aging_s) and aging_s >= MIN_AGING_S),
        f"aging_s must be a finite number of seconds >= {MIN_AGING_S} (or absent: strict levels), "
        f"got {aging_s!r}",
    )


@dataclass(frozen=True, slots=True)
class Fcfs:
    """First come, first served: ``(arrival, seq)``. Never changes; ignores the context."""

    name: str = field(default="fcfs", init=False)
    context_sensitive: bool = field(default=False, init=False)

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        return (item.view.arrival, item.seq), _INF


@dataclass(frozen=True, slots=True)
class StrictPriority:
    """Strict priority, lower ``view.priority`` first, FCFS within a level: ``(priority, arrival, seq)``.

    Static without ``aging_s``: a steady stream of high-priority work starves lower levels for as
    long as it lasts (each request waits until its ``queue_deadline``). With ``aging_s``, a waiting
    request rises one level per ``aging_s`` seconds, down to level 0 (:func:`_aged_level`).
    """

    aging_s: float | None = None
    name: str = field(default="strict_priority", init=False)
    context_sensitive: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        _check_aging(self.aging_s)

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        view = item.view
        level, valid_until = _aged_level(view.priority, view.arrival, now, self.aging_s)
        return (level, view.arrival, item.seq), valid_until


@dataclass(frozen=True, slots=True)
class SloTpot:
    """HyperFlexis's request priority queue (Algorithm 1, Q_R): tightest TPOT first, then arrival,
    within a priority level (0 first; requests without one are all level 0).

    Static: ``(priority, demoted, tpot_slo, arrival, seq)``; a request the dispatcher demoted
    under overload (:mod:`policies.demotion`) goes after every other of its level. The level
    comes first because mapped targets can collide: while no P0 traffic runs, Algorithm 2 relaxes
    lower levels' floors down to P0's, and when P0 joins it would queue behind that backlog on
    equal TPOT (measured: 35 % of P0 on time in the join window of Experiment B, against 95-100 %
    with the level first). ``aging_s``: a waiting request rises one level per ``aging_s`` seconds,
    down to level 0, as in :class:`StrictPriority`.
    """

    aging_s: float | None = None
    name: str = field(default="slo_tpot", init=False)
    context_sensitive: bool = field(default=False, init=False)
    uses_demotion: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        _check_aging(self.aging_s)

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        view = item.view
        demoted = 1.0 if item.demoted else 0.0
        if self.aging_s is None:  # (the hot path of HyperFlexis's arrivals: no call)
            return (float(view.priority), demoted, item.tpot_slo, view.arrival, item.seq), _INF
        level, valid_until = _aged_level(view.priority, view.arrival, now, self.aging_s)
        return (level, demoted, item.tpot_slo, view.arrival, item.seq), valid_until


@dataclass(frozen=True, slots=True)
class SjfAging:
    """Gimbal Algorithm 2 (§III-C): shortest prefill first, with aging after ``theta_age_s``.

    While waiting time ``w = now - arrival < theta_age_s`` the priority is the prompt length
    (Algorithm 2 line 6): key ``(1, prompt_tokens, arrival, seq)``. At ``w >= theta_age_s``
    (line 3) the request is "promoted to high priority regardless of size": key
    ``(0, arrival, 0, seq)``, i.e. aged requests go before every young one and among themselves
    keep arrival order (the paper sorts a FCFS waiting queue by priority, so equal priorities stay
    FCFS). One key change per request, at ``arrival + theta_age_s``. The paper recommends a value
    below the P99 TTFT under normal load and uses 5 s (§IV).
    """

    theta_age_s: float = 5.0
    name: str = field(default="sjf_aging", init=False)
    context_sensitive: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        _require(
            _is_number(self.theta_age_s) and self.theta_age_s >= 0,
            f"theta_age_s must be a finite number of seconds >= 0, got {self.theta_age_s!r}",
        )

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        view = item.view
        promote_at = view.arrival + self.theta_age_s
        if now >= promote_at:
            return (0.0, view.arrival, 0.0, item.seq), _INF
        return (1.0, float(view.prompt_tokens), view.arrival, item.seq), promote_at


@dataclass(frozen=True, slots=True)
class SlackEdf:
    """FlowPrefill S-EDF (§5.2, eq. 3): ``priority = sgn(slack) / deadline``, highest first.

    ``deadline = arrival + ttft_slo``; ``slack = deadline - now - TTFT_hat`` with
    ``TTFT_hat = ctx.predicted_prefill_s(prompt_tokens)`` (the paper fits TTFT to token count; we
    use the online throughput estimate). The paper calls the top request "the one with the earliest
    deadline and non-negative slack", so slack 0 counts as feasible.

    Rank-equivalent key (eq. 3 assumes deadlines > 0, true for the paper's timestamps; on a
    monotonic clock with an arbitrary origin ``1/deadline`` would misbehave, the ranking below does
    not): feasible requests ``(0, deadline, seq)`` — larger ``1/deadline`` is earlier deadline;
    infeasible requests ``(1, -deadline, seq)`` — ``-1/deadline`` is largest for the *latest*
    deadline, so among doomed requests the most recent goes first, all of them after every feasible
    one. One key change per request, when slack crosses zero at ``deadline - TTFT_hat``.
    """

    name: str = field(default="sedf", init=False)
    context_sensitive: bool = field(default=True, init=False)

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        deadline = item.ttft_deadline
        last_feasible = last_feasible_start(item, ctx)
        if now <= last_feasible:
            # still feasible at last_feasible itself (slack 0), so the flip happens just after it
            return (0.0, deadline, item.seq), _after(math.nextafter(last_feasible, _INF), now)
        return (1.0, -deadline, item.seq), _INF


def _piece_before(
    now: float, target: float, step: float, ratio: float, log_ratio: float
) -> tuple[float, float]:
    """For ``now < target``: ``(lo, hi)`` on the grid ``{0, step, step*ratio, step*ratio^2, ...}`` with
    ``target - hi <= now < target - lo``.

    Membership is tested in time (not on ``target - now``) so it agrees bit for bit with the
    ``valid_until = target - lo`` the caller returns: re-evaluating anywhere in the piece gives the
    same piece.
    """
    if now >= target - step:
        return 0.0, step
    j = max(1, math.ceil(math.log((target - now) / step) / log_ratio))
    hi = step * ratio**j
    while now < target - hi:  # fix log rounding in either direction
        j += 1
        hi = step * ratio**j
    lo = step * ratio ** (j - 1)
    while j > 1 and now >= target - lo:
        j -= 1
        hi, lo = lo, step * ratio ** (j - 1)
    return lo, hi


def _piece_after(
    now: float, target: float, step: float, ratio: float, log_ratio: float
) -> tuple[float, float]:
    """For ``now >= target``: ``(lo, hi)`` on the same grid with ``target + lo <= now < target + hi``."""
    if now < target + step:
        return 0.0, step
    j = max(0, math.floor(math.log((now - target) / step) / log_ratio))
    hi = step * ratio ** (j + 1)
    while now >= target + hi:
        j += 1
        hi = step * ratio ** (j + 1)
    lo = step * ratio**j
    while j > 0 and now < target + lo:
        j -= 1
        hi, lo = lo, step * ratio**j
    return lo, hi


@dataclass(frozen=True, slots=True)
class KairosUrgency:
    """Kairos urgency (§3.1, eq. 1) normalised by input length (Algorithm 1 line 8), highest first.

    ``u = (SLO - (T_finish - arrival)) / SLO / input_len``, sorted descending (Algorithm 1 line 11).
    ``T_finish`` is Algorithm 2's FCFS prediction: the backlog queued ahead drains at
    ``prefill_engines * prefill_tokens_per_s`` (the online estimate from ``ctx``), then the request
    prefills for ``ctx.predicted_prefill_s(input_len)``.

    Static phase (exact). With backlog ``B`` stamped at admission (``prefill_tokens_ahead``), the
    request's FCFS start is ``S = arrival + B / fleet_rate``. Evaluated at any ``t < S`` while the
    fleet drains at the estimated rate, Algorithm 2 gives ``T_finish = t + (B - rate * (t -
    arrival)) / rate + d = S + d``: the same value, so the urgency is a per-request constant and a
    static key is exactly the paper's order until ``S`` (rate changes re-key via the context).

    Moving phase (bounded granularity). Past ``S`` the backlog ahead is taken as drained (a lower
    bound on Algorithm 2's estimate), ``T_finish = t + d`` and ``u(t) = (L - t) / (SLO * len)`` with
    ``L = arrival + SLO - d``. Two such lines with different ``SLO * len`` cross, so no static key is
    rank-equivalent. We re-key on a geometric grid of the slack ``L - t`` (and of the lateness
    ``t - L`` once negative): grid points ``0, min_step_s, min_step_s*(1+rel_precision), ...``.
    Inside a piece the key uses the slack at the piece's start, so keys are within a factor
    ``1 + rel_precision`` of the exact urgency and each request is re-keyed about
    ``log(slack / min_step_s) / log(1 + rel_precision)`` times (≈ 21 for 1 s of slack with the
    defaults) plus the same for each decade of lateness.

    Key: feasible ``(0, -u, arrival, seq)``; late ``(1, |u|, -SLO*len, seq)`` (the least late per
    unit of work first, ties to the larger job whose urgency falls slowest).
    """

    rel_precision: float = 0.25
    min_step_s: float = 0.01
    name: str = field(default="kairos", init=False)
    context_sensitive: bool = field(default=True, init=False)
    uses_backlog: bool = field(default=True, init=False)
    _ratio: float = field(default=0.0, init=False, repr=False, compare=False)
    _log_ratio: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require(
            _is_number(self.rel_precision) and 0 < self.rel_precision <= 10,
            f"rel_precision must be a number in (0, 10], got {self.rel_precision!r}",
        )
        _require(
            _is_number(self.min_step_s) and self.min_step_s > 0,
            f"min_step_s must be a finite number of seconds > 0, got {self.min_step_s!r}",
        )
        # cached for the key's hot path; frozen dataclasses set derived fields this way
        object.__setattr__(self, "_ratio", 1.0 + self.rel_precision)
        object.__setattr__(self, "_log_ratio", math.log1p(self.rel_precision))

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        view = item.view
        arrival = view.arrival
        prompt = view.prompt_tokens
        rate = ctx.prefill_tokens_per_s
        slo = item.ttft_slo if item.ttft_slo > 1e-9 else 1e-9
        weight = slo * (prompt if prompt > 1 else 1)  # u = slack / weight
        latest_start = arrival + slo - ctx.prefill_base_s - (prompt if prompt > 0 else 0) / rate
        backlog = item.prefill_tokens_ahead
        fcfs_start = arrival + backlog / (rate * ctx.prefill_engines) if backlog else arrival
        if now < fcfs_start:
            # static phase: Algorithm 2's prediction does not move while the backlog drains on time
            slack = latest_start - fcfs_start
            if slack > 0:
                return (0.0, -slack / weight, arrival, item.seq), fcfs_start
            return (1.0, -slack / weight, -weight, item.seq), fcfs_start
        if now < latest_start:
            lo, hi = _piece_before(now, latest_start, self.min_step_s, self._ratio, self._log_ratio)
            return (0.0, -hi / weight, arrival, item.seq), _after(latest_start - lo, now)
        lo, hi = _piece_after(now, latest_start, self.min_step_s, self._ratio, self._log_ratio)
        return (1.0, lo / weight, -weight, item.seq), _after(latest_start + hi, now)


def _clone(
    item: QueuedRequest, prefill_tokens_ahead: int | None, flow_round: float | None, demoted: bool
) -> QueuedRequest:
    """``item`` with its three stamps set; equal to ``dataclasses.replace`` but ~4x faster: the
    queue stamps every Kairos and flow-control push, and ``replace`` on a frozen slotted dataclass
    costs several µs (field introspection + ``__init__``). Keep in step with the fields of
    QueuedRequest (a test compares it against ``replace``)."""
    clone = object.__new__(QueuedRequest)
    put = object.__setattr__
    put(clone, "view", item.view)
    put(clone, "ttft_slo", item.ttft_slo)
    put(clone, "tpot_slo", item.tpot_slo)
    put(clone, "seq", item.seq)
    put(clone, "queue_deadline", item.queue_deadline)
    put(clone, "batch_deadlines", item.batch_deadlines)
    put(clone, "prefill_tokens_ahead", prefill_tokens_ahead)
    put(clone, "flow_round", flow_round)
    put(clone, "demoted", demoted)
    return clone


def with_prefill_backlog(item: QueuedRequest, tokens: int) -> QueuedRequest:
    """``item`` with ``prefill_tokens_ahead = tokens``."""
    return _clone(item, tokens, item.flow_round, item.demoted)


def with_demotion(item: QueuedRequest, demoted: bool) -> QueuedRequest:
    """``item`` demoted (or no longer): what :class:`LateLast` ranks it by."""
    return _clone(item, item.prefill_tokens_ahead, item.flow_round, demoted)


def with_flow_round(item: QueuedRequest, flow_round: float) -> QueuedRequest:
    """``item`` with ``flow_round`` set."""
    return _clone(item, item.prefill_tokens_ahead, flow_round, item.demoted)


def robust_effective_deadline(deadlines: Sequence[float]) -> float:
    """MFS Robust Effective Deadline of one batch (§4.4.2, Appendix B step 1), seconds.

    Sort the deadlines, split at the largest gap ``k* = argmax_k (d_{k+1} - d_k)`` (first one on
    ties) into a tight and a loose sub-batch, and return ``f * D_min^T + (1 - f) * D_min^Lo`` with
    ``f = k* / n`` the share of tight requests. A single deadline is its own RED.
    """
    if not deadlines:
        raise ValueError("robust_effective_deadline needs at least one deadline")
    ordered = sorted(deadlines)
    n = len(ordered)
    if n == 1:
        return ordered[0]
    split = max(range(1, n), key=lambda k: (ordered[k] - ordered[k - 1], -k))
    tight_share = split / n
    return tight_share * ordered[0] + (1.0 - tight_share) * ordered[split]


def with_batch(items: Sequence[QueuedRequest]) -> list[QueuedRequest]:
    """The members of one batch, each carrying every member's TTFT deadline (``batch_deadlines``).

    When a member joins, call it with the newcomer and the batch's members still queued, push the
    newcomer and re-queue the others (remove, then push the returned item; ``seq`` is kept, so
    ties still break by admission): RED is a property of the whole batch, and a member keyed with
    an older deadline set would rank apart from its peers. The tuple is shared by all members
    (one allocation per batch change).
    """
    if not items:
        return []
    deadlines = tuple(i.ttft_deadline for i in items)
    return [replace(i, batch_deadlines=deadlines) for i in items]


@dataclass(frozen=True, slots=True)
class RobustEffectiveDeadline:
    """MFS RED ordering (§4.4.2) with soft overload control (Appendix B steps 2-3).

    MFS orders *batches*, not requests: requests that run together share one fate, so a batch is
    ranked by ``RED = f * D_min^T + (1 - f) * D_min^Lo`` over its members' deadlines (see
    :func:`robust_effective_deadline`) instead of its earliest deadline, and a few outlier-tight
    members cannot lift a mostly-loose batch over globally more urgent work (the Piggyback
    effect). Main queue: ``(0, RED, ttft_deadline, seq)``, RED read from the item's
    ``batch_deadlines``; members of a batch share one RED, so they sort together, tightest first. A
    request that declares no batch is a batch of one, and the order is then EDF on its TTFT
    deadline: RED only differs from EDF when the caller fills ``batch_deadlines``.

    Black Hole control: once a request can no longer meet its own TTFT deadline even if dispatched
    now (``now > deadline - ctx.predicted_prefill_s(prompt_tokens)``) it is demoted, not dropped,
    to the Scavenger class ``(1, RED, ttft_deadline, seq)``, served only when the main class is
    empty. MFS checks a batch's predicted completion against ``D_min^Lo`` because its members run
    as one synchronous batch; here members are dispatched one by one, so each is judged against
    its own deadline with its own prefill.

    One key change per request (the demotion). RED is static between batch changes, as in the
    paper (recomputed "upon batch arrival and departure", not per step); a batch change re-queues
    the members with new ``batch_deadlines`` (:func:`with_batch`), which re-keys them.
    ``scavenger=False`` disables the demotion (pure RED order, static).
    """

    scavenger: bool = True
    name: str = field(default="red", init=False)
    context_sensitive: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        _require(isinstance(self.scavenger, bool), f"scavenger must be true or false, got {self.scavenger!r}")

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        deadline = item.ttft_deadline
        red = item.effective_deadline
        if not self.scavenger:
            return (0.0, red, deadline, item.seq), _INF
        last_feasible = deadline - ctx.predicted_prefill_s(item.view.prompt_tokens)
        if now <= last_feasible:
            return (0.0, red, deadline, item.seq), _after(math.nextafter(last_feasible, _INF), now)
        return (1.0, red, deadline, item.seq), _INF


@dataclass(frozen=True, slots=True)
class FlowControl:
    """llm-d-style flow control: priority bands, then fairness between tenants, then EDF.

    Key ``(band, round, ttft_deadline, seq)``, smaller first:

    * ``band`` is ``view.priority`` (0 is the most urgent; negative values are more urgent still).
      Bands are strict, as llm-d's priority bands: a band is served only while every more urgent
      band is empty. Shedding under saturation (:func:`policies.flow_control.shed_victim`) takes
      the least urgent band's newest request first.
    * ``round`` (``item.flow_round``) is the fair-queueing round of the request if it is its
      flow's head (a flow: one tenant's requests in one band; its head: its earliest TTFT
      deadline), ``inf`` if it is parked behind its flow's head. The heads of a band take one
      round each in turn (start-time fair queueing, one request per round): the tenants with work
      queued are served round robin, and a tenant that starts sending joins the current round
      instead of waiting behind another tenant's backlog. The admission queue stamps the rounds
      (:class:`policies.flow_control.FlowRounds`, for orders with ``uses_flows``); an unstamped
      item is in round 0, so without the stamps the order is strict priority then EDF.
    * within a round, earliest TTFT deadline first (so is each flow's head, EDF within a tenant).

    The first request in order is exactly llm-d's choice (band, then the flows' heads round
    robin, each its tenant's earliest deadline); parked requests follow their band's heads by
    deadline, an approximation of the later rounds. The key never changes by itself (valid
    forever) and ignores the context: re-keys come only from the stamps, at most two per arrival
    (the arrival displaces its flow's head, which is parked) and one per departure (the flow's
    next request becomes its head, one round later).

    Bands are strict, as llm-d's: no aging (the fair-queueing rounds are counted per band, and a
    request aged into another band would carry a round of its own band's count).
    """

    name: str = field(default="flow_control", init=False)
    context_sensitive: bool = field(default=False, init=False)
    uses_flows: bool = field(default=True, init=False)

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        flow_round = item.flow_round
        return (
            float(item.view.priority),
            0.0 if flow_round is None else flow_round,
            item.view.arrival + item.ttft_slo,
            item.seq,
        ), _INF


@dataclass(frozen=True, slots=True)
class Wspt:
    """Dynamo-style WSPT queue: weighted shortest processing time first (Smith's rule).

    Highest ``weight / service`` first, where

    * ``service = ctx.predicted_prefill_s(prompt_tokens) + decode_share * max_output_tokens *
      ctx.decode_step_s``: the predicted time the request occupies an engine, from its lengths and
      the fleet's current latency estimates (``decode_share`` 0: prefill only, Dynamo's token cost);
    * ``weight = priority_factor ** -priority`` (each level more urgent weighs ``priority_factor``
      times more), divided by ``ttft_slo`` when ``urgency`` is on (a 0.5 s TTFT target weighs
      four times a 2 s one).

    Key ``(tier, log(service) - log(weight), arrival, seq)``: the logarithm ranks exactly as
    ``-weight / service`` and stays finite for any priority; ``tier`` is ``view.priority`` when
    ``strict_priority`` (Dynamo's strict tiers: WSPT within a tier), else 0. Ties by arrival.

    Static in time: no key changes by itself. It uses the context, so the queue re-keys every
    request when an estimate moves beyond its tolerance; nothing else re-keys. Like every SPT rule
    it can starve long low-weight requests under sustained load: the class's queue timeout bounds
    their wait.
    """

    priority_factor: float = 2.0
    urgency: bool = True
    decode_share: float = 1.0
    strict_priority: bool = False
    name: str = field(default="wspt", init=False)
    context_sensitive: bool = field(default=True, init=False)
    _log_factor: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require(
            _is_number(self.priority_factor) and self.priority_factor >= 1.0,
            f"priority_factor must be a finite number >= 1, got {self.priority_factor!r}",
        )
        _require(
            _is_number(self.decode_share) and self.decode_share >= 0.0,
            f"decode_share must be a finite number >= 0, got {self.decode_share!r}",
        )
        _require(isinstance(self.urgency, bool), f"urgency must be true or false, got {self.urgency!r}")
        _require(
            isinstance(self.strict_priority, bool),
            f"strict_priority must be true or false, got {self.strict_priority!r}",
        )
        object.__setattr__(self, "_log_factor", math.log(self.priority_factor))

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> KeyResult:
        view = item.view
        service = predicted_service_s(view, ctx, self.decode_share)
        # log(service / weight) = log(service) + priority * log(factor) [+ log(ttft_slo)]
        cost = math.log(service if service > 1e-12 else 1e-12) + view.priority * self._log_factor
        if self.urgency:
            cost += math.log(item.ttft_slo if item.ttft_slo > 1e-9 else 1e-9)
        tier = float(view.priority) if self.strict_priority else 0.0
        return (tier, cost, view.arrival, item.seq), _INF


ORDERS: dict[str, Callable[..., QueueOrder]] = {
    "fcfs": Fcfs,
    "strict_priority": StrictPriority,
    "slo_tpot": SloTpot,
    "sjf_aging": SjfAging,
    "sedf": SlackEdf,
    "kairos": KairosUrgency,
    "red": RobustEffectiveDeadline,
    "flow_control": FlowControl,
    "wspt": Wspt,
}


def _accepted_params(factory: Callable[..., QueueOrder]) -> dict[str, Any]:
    """Parameter name -> default of a factory (``inspect.Parameter.empty`` when required)."""
    return {
        p.name: p.default
        for p in inspect.signature(factory).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _describe(accepted: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "no parameters"


class LateLast:
    """Any order with the requests that can no longer meet their TTFT (even dispatched now, on the
    context's estimate) moved behind all the others, each part keeping the inner order.

    For HyperFlexis's first pass, which skips late requests anyway (p < 0.5 <= theta): under
    overload its window of ``max_scan`` candidates was otherwise all late requests, re-read and
    skipped one by one on every turn, while feasible ones waited beyond the window. A request
    changes part once, at its last feasible start (the queue re-keys it then).
    """

    __slots__ = ("inner", "name", "uses_backlog", "uses_demotion", "uses_flows")
    context_sensitive = True

    def __init__(self, inner: QueueOrder) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_backlog: bool = getattr(inner, "uses_backlog", False)
        self.uses_flows: bool = getattr(inner, "uses_flows", False)
        self.uses_demotion: bool = getattr(inner, "uses_demotion", False)

    def key(self, item: QueuedRequest, now: float, ctx: OrderContext) -> tuple[tuple[float, ...], float]:
        inner_key, valid_until = self.inner.key(item, now, ctx)
        turns_late = last_feasible_start(item, ctx)
        if now > turns_late:
            return (1.0, *inner_key), valid_until
        return (0.0, *inner_key), min(valid_until, _after(math.nextafter(turns_late, _INF), now))


def make_order(name: str, params: Mapping[str, Any] | None = None) -> QueueOrder:
    """Build the queue order ``name`` with profile ``params``.

    Raises :class:`PolicyConfigError` naming the order and listing its accepted parameters (with
    defaults) on an unknown name, an unknown parameter or a bad value.
    """
    factory = ORDERS.get(name)
    if factory is None:
        raise PolicyConfigError(
            f"unknown queue order {name!r}; known queue orders: {', '.join(sorted(ORDERS))}"
        )
    given = dict(params or {})
    accepted = _accepted_params(factory)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise PolicyConfigError(
            f"queue order {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"it accepts: {_describe(accepted)}"
        )
    try:
        return factory(**given)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"queue order {name!r}: {exc}; it accepts: {_describe(accepted)}") from exc
