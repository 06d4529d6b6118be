"""Classification, priority-to-SLO mapping, latency models and SLO accounting for the gateway.

The decisions are pure policies (``policies.slo``, ``policies.priority_mapping``,
``policies.latency_fit``); this module holds their explicit state between requests, reads the
hints from request headers, and turns completions into metrics and mapping-window entries. The
engines' latency models are learnt from the engine steps the gateway sees
(:class:`~gateway.dispatch.latency_learner.LatencyLearner`, attached to the fleet by
:meth:`SloService.attach`), not from whole requests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from gateway import metrics
from gateway.api.auth import CLIENT_SOURCES, OPEN_POLICY, clamp_hints, clamp_target
from gateway.api.errors import bad_request
from gateway.dispatch.core import ClassLimits
from gateway.dispatch.latency_learner import LatencyLearner
from gateway.fleet.registry import Fleet
from gateway.serving.call import Call
from gateway.settings import ApiKeyPolicy, Settings, key_fingerprint
from gateway.sim.profiles import load_profile
from policies.api import PolicyConfigError
from policies.decode_placement import judged_decode
from policies.latency import LatencyCoefficients
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL, MIN_SAMPLES, Coeffs, LatencyModel
from policies.priority_mapping import PriorityMappingState, observe_completion, set_pending
from policies.slo import (
    SloHints,
    SloProfile,
    SloSource,
    SloTarget,
    classify,
    classify_mapped,
    initial_priority_state,
    parse_slo_profile,
)

#: explicit targets beyond a day are clamped: no engine or timer needs more, and the gateway
#: turns them into integer deadlines an engine must accept
MAX_TARGET_MS = 86_400_000.0
#: priorities given in a header or body stay within this many levels either side of 0
MAX_PRIORITY_MAGNITUDE = 1_000_000


def _target_ms(headers: Mapping[bytes, bytes], name: bytes) -> float | None:
    """A client's explicit target in ms: a positive number, clamped to a day (so is infinity)."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isnan(value):
        raise bad_request(f"header {name.decode()} must be a positive number of milliseconds", name.decode())
    return min(value, MAX_TARGET_MS)


def header_priority(raw: bytes | None) -> int | None:
    """``x-priority`` as an integer (``None`` when absent); anything else is a 400."""
    if raw is None:
        return None
    text = raw.strip()
    digits = text[1:] if text[:1] in (b"-", b"+") else text
    if not digits.isdigit() or len(digits) > 7:
        raise bad_request("header x-priority must be an integer", "x-priority")
    return max(-MAX_PRIORITY_MAGNITUDE, min(MAX_PRIORITY_MAGNITUDE, int(text)))


def header_text(headers: Mapping[bytes, bytes], name: bytes) -> str | None:
    """A short printable-ASCII header value, or a 400 naming the header."""
    raw = headers.get(name)
    if raw is None:
        return None
    if len(raw) > 256 or not raw.isascii() or not raw.decode().isprintable():
        raise bad_request(f"header {name.decode()} must be printable ASCII of at most 256 characters")
    return raw.decode()


class SloService:
    def __init__(self, settings: Settings) -> None:
        path = settings.slo_profile_path()
        self.profile: SloProfile = parse_slo_profile(path.read_text(), str(path))
        for key, policy in settings.key_policies().items():
            # a misspelt task would fall back to the default class on every request, unnoticed
            if policy.task is not None and policy.task not in self.profile.classes:
                raise PolicyConfigError(
                    f"the task {policy.task!r} of API key {key_fingerprint(key)} is not a class of SLO "
                    f"profile {self.profile.name!r} (defined: {', '.join(sorted(self.profile.classes))})"
                )
        self.mapping: PriorityMappingState | None = initial_priority_state(self.profile)
        priors: dict[str, tuple[Coeffs, Coeffs]] = {}
        chunks: dict[str, int | None] = {}
        for engine in settings.engines:
            prefill, decode = DEFAULT_PREFILL, DEFAULT_DECODE
            chunks[engine.engine_id] = None
            if engine.latency_profile:
                profile = load_profile(engine.latency_profile, settings.profiles_dir)
                prefill, decode = profile.latency.prefill, profile.latency.decode
                if profile.chunked_prefill:
                    chunks[engine.engine_id] = profile.max_num_batched_tokens
            scale = engine.time_scale  # the engine runs this much faster than its profile
            prefill = (prefill[0] / scale, prefill[1] / scale, prefill[2] / scale)
            decode = (decode[0] / scale, decode[1] / scale, decode[2] / scale)
            priors[engine.engine_id] = (prefill, decode)
        self.latency = LatencyLearner(priors, chunks)
        self.levels = len(self.profile.priority.levels) if self.profile.priority else 0
        self.pending_by_priority: dict[int, int] = {}
        #: whether requests for a model wait for an engine at a time of the driver's clock (the
        #: dispatch core's queue, wired by build_core): a backlog ends the priority mapper's
        #: relaxed floor (see assign()); read only with a clock (attach) and when the mapper runs
        self.backlog: Callable[[str, float], bool] = lambda model, now: False
        self._clock: Callable[[], float] | None = None
        #: the profile's classes' queue bounds, made once each (read on every arrival)
        self._limits: dict[str, ClassLimits] = {}

    # -- classification --------------------------------------------------------------------------

    def classify(
        self,
        headers: Mapping[bytes, bytes],
        body_priority: int | None,
        policy: ApiKeyPolicy = OPEN_POLICY,
        model: str = "",
        record: bool = True,
    ) -> tuple[SloTarget, int | None]:
        """The request's targets and its effective priority, within what its key allows.

        The priority comes from ``x-priority`` or else the body's ``priority`` (vLLM's field);
        ``None`` when the request gave neither. Malformed claims are a 400. The key's policy then
        caps the claims (:func:`clamp_hints`) and the resulting targets (:func:`clamp_target`).
        With a priority profile the priority is clamped into the profile's levels, so every later
        use (queue order, pending counts, the mapper's windows) sees the level the targets came from.
        ``record``: the request will be served, so the mapper's state moves with its assignment
        (False for one refused anyway, an unknown model say: it is classified only so that its
        malformed claims are still the error it gets, and must not move the next request's spike
        correction).
        """
        priority = header_priority(headers.get(b"x-priority"))
        if priority is None and body_priority is not None:
            priority = max(-MAX_PRIORITY_MAGNITUDE, min(MAX_PRIORITY_MAGNITUDE, body_priority))
        claims = SloHints(
            ttft_ms=_target_ms(headers, b"x-slo-ttft-ms"),
            tpot_ms=_target_ms(headers, b"x-slo-tpot-ms"),
            task=header_text(headers, b"x-slo-task"),
            priority=priority,
        )
        hints = clamp_hints(claims, policy)
        priority = hints.priority
        if priority is not None and self.levels:
            priority = min(max(priority, 0), self.levels - 1)
            hints = dataclasses.replace(hints, priority=priority)
        if self.mapping is None:
            target = classify(hints, self.profile)
        else:
            clock = self._clock

            def backlog() -> bool:
                return clock is not None and self.backlog(model, clock())

            target, mapping = classify_mapped(hints, self.profile, self.mapping, backlog)
            if record:
                self.mapping = mapping
        floor = self._level_floor(policy)
        if floor is None:
            return clamp_target(target, policy), priority
        # the key's own task is the operator's choice, not a claim of the client's
        key_task = policy.task is not None and not (policy.task_override and claims.task)
        sources = CLIENT_SOURCES - {SloSource.TASK} if key_task else CLIENT_SOURCES
        return clamp_target(target, policy, floor, sources), priority

    def _level_floor(self, policy: ApiKeyPolicy) -> tuple[float, float] | None:
        """The TTFT and TPOT floors of the key's ``max_priority`` level (see :func:`clamp_target`);
        None when the key has no ceiling or the profile no levels."""
        ceiling = policy.max_priority
        if ceiling is None or ceiling <= 0 or self.profile.priority is None:
            return None  # (a ceiling at the highest level bounds nothing)
        levels = self.profile.priority.levels
        bounds = levels[min(max(ceiling, 0), len(levels) - 1)].bounds()
        return bounds.ttft_min_s, bounds.tpot_min_s

    # -- pending and completions -----------------------------------------------------------------

    def started(self, priority: int | None) -> None:
        """A request with ``priority`` entered the gateway (the mapper's contention rule counts it)."""
        if priority is None or self.mapping is None:
            return
        self.pending_by_priority[priority] = self.pending_by_priority.get(priority, 0) + 1
        self.mapping = set_pending(self.mapping, self.pending_by_priority)

    def left(self, priority: int | None) -> None:
        """The request counted by :meth:`started` left the gateway, however it ended."""
        if priority is None or self.mapping is None:
            return
        self.pending_by_priority[priority] = max(0, self.pending_by_priority.get(priority, 1) - 1)
        self.mapping = set_pending(self.mapping, self.pending_by_priority)

    def attach(self, fleet: Fleet, clock: Callable[[], float], step_gap_s: float) -> None:
        """Learn the engines' latency models from ``fleet``'s streamed tokens and scrapes (see
        :meth:`LatencyLearner.attach`); both drivers call this once, with their own clock (the
        one their dispatch core is given)."""
        self._clock = clock
        self.latency.attach(fleet, clock, step_gap_s)

    @property
    def models(self) -> dict[str, LatencyModel]:
        """Every engine's current latency model (coefficients; the samples live in the learner)."""
        return self.latency.models

    def account(self, call: Call, status: int) -> str | None:
        """Count the request once with its outcome and learn from its timing; returns the outcome
        (``None`` for a client mistake, which is no SLO miss)."""
        outcome = self._outcome(call, status)
        if outcome is not None:
            metrics.deferred(metrics.SLO_REQUESTS, call.target.slo_class, outcome).inc()
        if status == 200 and call.request.stream and call.first_at:
            ttft = call.first_at - call.arrival
            tpot = call.tpot_s
            self._judge_objectives(call.target, ttft, tpot)
            if call.engine_id is not None:
                dispatched = call.prefill_dispatched_at or call.dispatched_at
                queue_s = dispatched - call.arrival if dispatched else 0.0
                self.learn(call.priority, queue_s, ttft, tpot)
        return outcome

    def _outcome(self, call: Call, status: int) -> str | None:
        target = call.target
        if status == 499:
            return "cancelled"
        if status in (429, 503):
            return "rejected"
        if status >= 500:
            return "error"
        if status >= 400:
            return None
        if call.request.stream:
            if not call.first_at:
                return "error"
            if call.first_at - call.arrival > target.ttft_s:
                return "missed_ttft"
            tpot = call.tpot_s
            if tpot is not None and tpot > target.tpot_s:
                return "missed_tpot"
            return "met"
        # Non-streamed: no token timing, so the whole answer is held to the time a stream meeting
        # both targets would have taken to deliver the same number of tokens.
        tokens = call.completion_tokens if call.completion_tokens is not None else call.request.max_tokens
        choices = call.request.choices
        if call.completion_tokens is not None and choices > 1:
            # the choices are generated side by side: the answer takes as long as its longest,
            # which the total bounds (each other choice has a token at least) as does max_tokens
            # (n = 4 of 100 tokens each was allowed 399 steps, four times what it should)
            tokens = min(tokens - (choices - 1), call.request.max_tokens)
        allowed = target.ttft_s + target.tpot_s * max(0, tokens - 1)
        end = call.finished_at or call.arrival
        return "met" if end - call.arrival <= allowed else "missed_latency"

    def _judge_objectives(self, target: SloTarget, ttft_s: float, tpot_s: float | None) -> None:
        cls = target.slo_class
        ttft_ok = ttft_s <= target.ttft_s
        tpot_ok = tpot_s is None or tpot_s <= target.tpot_s
        metrics.deferred(metrics.SLO_OUTCOMES, cls, "ttft", "met" if ttft_ok else "missed").inc()
        metrics.deferred(metrics.SLO_OUTCOMES, cls, "tpot", "met" if tpot_ok else "missed").inc()
        metrics.deferred(metrics.SLO_OUTCOMES, cls, "both", "met" if ttft_ok and tpot_ok else "missed").inc()

    def learn(self, priority: int | None, queue_s: float, ttft_s: float, tpot_s: float | None) -> None:
        """Feed the priority mapper's windows with one streamed request that was served: its time
        queued in the gateway, its TTFT and mean TPOT as the client saw them (the live gateway and
        the offline simulator both call this). Whole requests are no measure of an engine's step
        times (under load a TTFT is mostly waiting): the latency models learn from engine steps."""
        if self.mapping is not None and tpot_s is not None and priority is not None:
            self.mapping = observe_completion(self.mapping, priority, ttft_s, tpot_s, queue_s)

    def class_limits(self, slo_class: str) -> ClassLimits:
        """Queue bounds of ``slo_class`` from the profile (the defaults for a class it lacks)."""
        cached = self._limits.get(slo_class)
        if cached is not None:
            return cached
        try:
            limits = self.profile.queue_limits(slo_class)
        except KeyError:
            return ClassLimits()  # (not kept: only the profile's own classes are)
        made = self._limits[slo_class] = ClassLimits(
            limits.max_queued, limits.timeout_s, self.profile.class_ttft_s(slo_class)
        )
        return made

    def coefficients(self, engine_id: str) -> tuple[Coeffs, Coeffs]:
        """The engine's current eq.(1) and eq.(2) coefficients (the defaults for an unknown one)."""
        coefficients = self.latency.coefficients(engine_id)
        return (DEFAULT_PREFILL, DEFAULT_DECODE) if coefficients is None else coefficients

    def decode_judged(self, engine_ids: Sequence[str], context_tokens: int) -> dict[str, LatencyCoefficients]:
        """Each decode candidate's coefficients as the decode stage judges it: an engine whose
        decode model has learnt nothing yet by the pool's fastest learnt one
        (:func:`policies.decode_placement.judged_decode`)."""
        learner = self.latency
        learnt = {e: e in learner.models and learner.sample_counts(e)[1] >= MIN_SAMPLES for e in engine_ids}
        pool = [self.coefficients(e)[1] for e, known in learnt.items() if known]
        judged = {}
        for engine_id in engine_ids:
            prefill, decode = self.coefficients(engine_id)
            decode = judged_decode(decode, learnt[engine_id], pool, context_tokens)
            judged[engine_id] = LatencyCoefficients(*prefill, *decode)
        return judged
