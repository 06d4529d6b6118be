"""Which engine steps measure the latency model, and which scrape intervals the engine confirms."""

from __future__ import annotations

import dataclasses

import pytest

from policies.api import EngineState, EngineTiming
from policies.latency_fit import DecodeSample, PrefillSample
from policies.latency_samples import (
    MAX_PREFIX_HIT_SHARE,
    STEP_SLACK,
    TRUSTED,
    IntervalVerdict,
    SeenInterval,
    StepView,
    check_interval,
    step_sample,
)

DECODE = StepView(seconds=0.02, decodes=8, decode_context=4000, expected_decodes=8)
MIXED = dataclasses.replace(DECODE, prompts=(300, 40))


def test_a_pure_decode_step_is_a_decode_sample() -> None:
    assert step_sample(DECODE) == DecodeSample(4000, 8, 0.02)


def test_prompts_that_completed_together_with_decodes_are_one_mixed_prefill_sample() -> None:
    assert step_sample(MIXED) == PrefillSample((300, 40), 0.02, 4000, 8)
    alone = StepView(seconds=0.05, decodes=0, decode_context=0, expected_decodes=0, prompts=(512,))
    assert step_sample(alone) == PrefillSample((512,), 0.05)


@pytest.mark.parametrize(
    ("view", "why"),
    [
        (dataclasses.replace(DECODE, decodes=7), "a decoding request produced no token: not one step"),
        (dataclasses.replace(DECODE, decodes=9), "more tokens than requests decoding: two steps merged"),
        (dataclasses.replace(DECODE, other_prefill=True), "a pending prompt may have had a chunk in it"),
        (dataclasses.replace(MIXED, other_prefill=True), "a pending prompt may have shared the step"),
        (
            dataclasses.replace(MIXED, prompts_fresh=False),
            "a prompt had waited: it may have had a chunk before",
        ),
        (dataclasses.replace(MIXED, chunk_tokens=256), "more prompt than one step's budget: it was chunked"),
        (dataclasses.replace(DECODE, spread_s=0.006), "its events spread over a quarter of the step"),
        (dataclasses.replace(DECODE, seconds=0.0), "no duration"),
        (dataclasses.replace(DECODE, follows_whole_step=False), "its start was a broken burst's time"),
        (dataclasses.replace(DECODE, seconds=float("inf")), "no start"),
        (StepView(seconds=0.02, decodes=0, decode_context=0, expected_decodes=0), "nothing in it"),
    ],
)
def test_steps_that_do_not_measure_an_equation_are_no_sample(view: StepView, why: str) -> None:
    assert step_sample(view) is None, why


def test_the_chunk_budget_counts_the_decodes_too() -> None:
    assert step_sample(dataclasses.replace(MIXED, chunk_tokens=348)) is not None
    assert step_sample(dataclasses.replace(MIXED, chunk_tokens=347)) is None


# -- scrape intervals -------------------------------------------------------------------------------

TIMING = EngineTiming(
    steps=100.0,
    step_tokens=5000.0,
    prompt_tokens=3000.0,
    generation_tokens=2000.0,
    preemptions=0.0,
    finished=20.0,
    queue_s=0.5,
    prefill_s=2.0,
    decode_s=30.0,
)
BEFORE = EngineState(prefix_queries=3000.0, prefix_hits=0.0, timing=TIMING)


def after(**changes: float) -> EngineState:
    """BEFORE plus an interval of 50 steps and 400 tokens, with ``changes`` on top."""
    timing = dataclasses.replace(
        TIMING,
        steps=TIMING.steps + 50 + changes.pop("steps", 0),  # type: ignore[operator]
        generation_tokens=TIMING.generation_tokens + 400 + changes.pop("generated", 0),  # type: ignore[operator]
        prompt_tokens=TIMING.prompt_tokens + 1000,  # type: ignore[operator]
        preemptions=TIMING.preemptions + changes.pop("preempted", 0),  # type: ignore[operator]
    )
    hits = changes.pop("hits", 0.0)
    assert not changes
    return EngineState(prefix_queries=4000.0, prefix_hits=hits, timing=timing)


SEEN = SeenInterval(steps=50, tokens=400)


def test_an_interval_the_engine_agrees_with_is_trusted() -> None:
    assert check_interval(BEFORE, after(), SEEN) == TRUSTED
    # a step can end on either side of a scrape
    assert check_interval(BEFORE, after(steps=STEP_SLACK), SEEN) == TRUSTED
    assert check_interval(BEFORE, after(steps=-STEP_SLACK, generated=16), SEEN) == TRUSTED


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (after(steps=STEP_SLACK + 1), "steps unseen"),
        (after(steps=-STEP_SLACK - 1), "steps unseen"),
        (after(generated=100), "tokens unseen"),
        (after(preempted=1), "preemption"),
    ],
)
def test_work_the_gateway_did_not_see_refutes_the_interval(state: EngineState, reason: str) -> None:
    assert check_interval(BEFORE, state, SEEN) == IntervalVerdict(False, False, reason)


def test_a_restart_refutes_the_interval() -> None:
    restarted = EngineState(timing=EngineTiming(steps=3.0, generation_tokens=10.0))
    assert check_interval(BEFORE, restarted, SeenInterval(3, 10)).reason == "engine restarted"


def test_prefix_cache_hits_drop_the_prefill_samples_only() -> None:
    assert check_interval(BEFORE, after(hits=MAX_PREFIX_HIT_SHARE * 1000), SEEN) == TRUSTED
    assert check_interval(BEFORE, after(hits=100.0), SEEN) == IntervalVerdict(
        False, True, "prefix cache hits"
    )


def test_no_counters_no_check_and_no_baseline_no_trust() -> None:
    plain = EngineState(num_running=3)
    assert check_interval(None, plain, SEEN) == TRUSTED  # an engine that exports no timing
    assert check_interval(plain, plain, SEEN) == TRUSTED
    assert check_interval(None, BEFORE, SEEN) == IntervalVerdict(False, False, "no baseline")
    assert check_interval(plain, BEFORE, SEEN).reason == "no baseline"
    assert check_interval(BEFORE, plain, SEEN).reason == "timing counters vanished"


def test_figures_an_engine_does_not_export_are_not_checked() -> None:
    # SGLang: tokens and queue time, no steps, no preemptions
    sglang = EngineState(timing=EngineTiming(prompt_tokens=10.0, generation_tokens=100.0))
    later = EngineState(timing=EngineTiming(prompt_tokens=20.0, generation_tokens=150.0))
    assert check_interval(sglang, later, SeenInterval(steps=999, tokens=50)) == TRUSTED
    assert check_interval(sglang, later, SeenInterval(steps=10, tokens=20)).reason == "tokens unseen"
