"""Which observations measure the latency model, and what they measure: pure rules.

The gateway sees an engine's steps as bursts of stream events: a decode step ends with one token
for every request decoding there, at the same moment; a step that completes a prefill ends with
that request's first token too. :class:`StepView` is one such step as the gateway saw it (the
mechanism that builds it is ``gateway.dispatch.latency_learner``); :func:`step_sample` says
whether it is a clean measurement of eq.(1) or eq.(2) and turns it into a sample:

* a **decode sample** when every request that was decoding at the step's start produced its
  token, no prompt completed, and no prompt that could have run in the step was still pending
  (a chunk of it would have shared the step);
* a **prefill sample** when the prompts that completed are exactly the prompts that could have
  run (sent after the previous step began, so none had an earlier chunk, and none left pending),
  together with the decodes that shared the step (their share is taken out when fitting).

Anything else (a burst that does not account for every decoding request, prompts that waited or
were chunked, a burst whose events spread over much of the step, a step whose start is the time
of such a burst) is no sample: the learner would rather wait than fit queueing, as the old
TTFT-minus-queue samples did.

:func:`check_interval` then holds the samples of a scrape interval against the engine's own
counters (:class:`~policies.api.EngineTiming`): when the engine ran steps, generated tokens or
preempted requests the gateway did not see (another client, recomputation) or served prompts from
its prefix cache, that interval's samples are not trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.api import EngineState
from policies.latency_fit import DecodeSample, PrefillSample

#: a burst whose events arrive over more than this share of the step is not one clean step
MAX_SPREAD_SHARE = 0.25
#: engine steps a scrape interval may count beyond (or short of) the bursts the gateway saw: a step
#: can end on either side of a scrape
STEP_SLACK = 2
#: share of the prompt tokens an interval may serve from the prefix cache before its prefill
#: samples (which count whole prompts) stop describing the work done
MAX_PREFIX_HIT_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class StepView:
    """One engine step as the gateway saw it.

    ``seconds``: from the step's start (the previous step's tokens, or the first prompt's send when
    nothing was running) to its tokens. ``decodes``: distinct requests that produced a decode token;
    ``decode_context``: their summed current lengths (prompt + tokens so far) before it;
    ``expected_decodes``: requests that were decoding when the step began (each must produce one).
    ``prompts``: prompt lengths of the requests whose first token came. ``prompts_fresh``: all of
    them were sent after the previous step began. ``other_prefill``: a prompt sent before this
    step began was still waiting for its first token after it. ``spread_s``: first to last event
    of the burst. ``chunk_tokens``: the engine's token budget per step, when known (a prefill
    larger than it took several steps). ``follows_whole_step``: the step's start is known, as the
    previous burst was a whole step (:func:`whole_step`) or the engine was idle until a send.
    """

    seconds: float
    decodes: int
    decode_context: int
    expected_decodes: int
    prompts: tuple[int, ...] = ()
    prompts_fresh: bool = True
    other_prefill: bool = False
    spread_s: float = 0.0
    chunk_tokens: int | None = None
    follows_whole_step: bool = True


def whole_step(view: StepView) -> bool:
    """Whether the burst is one whole engine step: every request decoding produced its token, and
    the events came close together. The time of a burst that is not (part of a step whose tokens
    arrived split, or two steps run together) is no start for the next step either."""
    return view.decodes == view.expected_decodes and view.spread_s <= MAX_SPREAD_SHARE * view.seconds


def step_sample(view: StepView) -> PrefillSample | DecodeSample | None:
    """The sample the step is, or ``None`` when it does not cleanly measure one of the equations."""
    if not 0.0 < view.seconds < math.inf or not view.follows_whole_step or not whole_step(view):
        return None
    if view.other_prefill:
        return None
    if view.prompts:
        if not view.prompts_fresh:
            return None
        if view.chunk_tokens is not None and sum(view.prompts) + view.decodes > view.chunk_tokens:
            return None
        return PrefillSample(view.prompts, view.seconds, view.decode_context, view.decodes)
    if view.decodes <= 0:
        return None
    return DecodeSample(view.decode_context, view.decodes, view.seconds)


@dataclass(frozen=True, slots=True)
class SeenInterval:
    """What the gateway saw of one engine between two scrapes: the bursts (steps) and the stream
    events that carried content (tokens)."""

    steps: int
    tokens: int
    #: steps and tokens the gateway saw while this scrape and the one before were in flight: the
    #: engine counted them as of when it rendered its metrics, somewhere in that window, so its
    #: count may lack them (this interval) or hold them already (the one before)
    unsure_steps: int = 0
    unsure_tokens: int = 0


@dataclass(frozen=True, slots=True)
class IntervalVerdict:
    """Whether an interval's prefill and decode samples can be trusted, and if not why."""

    prefill: bool
    decode: bool
    reason: str = ""


TRUSTED = IntervalVerdict(True, True)


def _delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return None
    return after - before


def check_interval(
    before: EngineState | None, after: EngineState | None, seen: SeenInterval
) -> IntervalVerdict:
    """Hold what the gateway saw between two scrapes against what the engine counted.

    With no timing counters on either side there is nothing to check (an engine that exports
    none: the gateway's view is all there is). The first scrape with counters has no baseline: its
    interval is not trusted. Refuted when: a counter went backwards (the engine restarted); the
    engine preempted a request (it recomputed a prompt the gateway did not see); the engine ran
    more than :data:`STEP_SLACK` steps more or fewer than the bursts seen (and those seen while the
    scrapes were in flight, ``unsure_steps``); it generated more tokens than the gateway relayed,
    beyond what two steps carry (another client). Prefill samples alone
    are dropped when more than :data:`MAX_PREFIX_HIT_SHARE` of the prompt tokens hit the prefix
    cache (a cached prompt costs less than its length says).
    """
    old = before.timing if before is not None else None
    new = after.timing if after is not None else None
    if new is None:
        return TRUSTED if old is None else IntervalVerdict(False, False, "timing counters vanished")
    if old is None:
        return IntervalVerdict(False, False, "no baseline")
    deltas = [
        _delta(getattr(old, name), getattr(new, name))
        for name in ("steps", "generation_tokens", "prompt_tokens", "preemptions")
    ]
    if any(d is not None and d < 0 for d in deltas):
        return IntervalVerdict(False, False, "engine restarted")
    steps, generated, _, preempted = deltas
    if preempted:
        return IntervalVerdict(False, False, "preemption")
    if steps is not None and abs(steps - seen.steps) > STEP_SLACK + seen.unsure_steps:
        return IntervalVerdict(False, False, "steps unseen")
    if generated is not None:
        per_step = seen.tokens / seen.steps if seen.steps else 1.0
        if generated > seen.tokens + seen.unsure_tokens + STEP_SLACK * per_step + 1:
            return IntervalVerdict(False, False, "tokens unseen")
    assert before is not None and after is not None
    queried = after.prefix_queries - before.prefix_queries
    hits = after.prefix_hits - before.prefix_hits
    if queried > 0 and hits > MAX_PREFIX_HIT_SHARE * queried:
        return IntervalVerdict(False, True, "prefix cache hits")
    return TRUSTED
