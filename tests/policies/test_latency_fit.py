"""Latency re-fit (eq.(1)/(2), appendix A), token budget (eq.(5)) and maturity time (Algorithm 1)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from policies.latency_fit import (
    TOKEN_COST_FLOOR,
    UNBOUNDED_TOKENS,
    Coeffs,
    DecodeSample,
    LatencyModel,
    PrefillSample,
    fit_decode,
    fit_prefill,
    maturity_time,
    predict_decode,
    predict_prefill,
    prediction_error,
    token_budget,
)

# 7B-class engine: 15 ms prefill overhead, 80 us/token, quadratic 1.5e-8 s/token²;
# decode step 8 ms + 2 us per token of context + 0.1 ms per request
TRUE_PREFILL: Coeffs = (0.015, 8e-5, 1.5e-8)
TRUE_DECODE: Coeffs = (0.008, 2e-6, 1e-4)
FAR_PRIOR: Coeffs = (1.0, 1.0, 1.0)


def prefill_samples(seed: int, n: int, noise: float, log_lengths: bool = False) -> list[PrefillSample]:
    """Batches of 1-16 prompts (appendix A profiles lengths 4..2020), multiplicative noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = int(rng.choice([1, 2, 4, 8, 16]))
        if log_lengths:
            lengths = tuple(int(x) for x in np.exp(rng.uniform(math.log(4), math.log(2020), batch)))
        else:
            lengths = tuple(int(x) for x in rng.integers(4, 2021, batch))
        seconds = predict_prefill(TRUE_PREFILL, lengths) * (1.0 + rng.normal(0.0, noise))
        out.append(PrefillSample(lengths, seconds))
    return out


def decode_samples(seed: int, n: int, noise: float) -> list[DecodeSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = int(rng.integers(1, 193))  # appendix A batch sizes 1..192
        total = int(batch * rng.uniform(50, 1500))
        out.append(
            DecodeSample(
                total, batch, predict_decode(TRUE_DECODE, total, batch) * (1.0 + rng.normal(0, noise))
            )
        )
    return out


def rel(got: Coeffs, want: Coeffs) -> list[float]:
    return [abs(g / w - 1.0) for g, w in zip(got, want, strict=True)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_prefill_fit_recovers_known_coefficients(seed: int) -> None:
    got = fit_prefill(prefill_samples(seed, 400, noise=0.02), FAR_PRIOR)
    a_err, b_err, c_err = rel(got, TRUE_PREFILL)
    assert a_err < 0.05 and b_err < 0.03
    assert c_err < 0.10  # the quadratic term is small next to the linear one, so less determined
    truth = [PrefillSample((n,), predict_prefill(TRUE_PREFILL, (n,))) for n in (4, 64, 512, 2020)]
    truth.append(PrefillSample((2020,) * 16, predict_prefill(TRUE_PREFILL, (2020,) * 16)))
    assert prediction_error(got, truth) < 0.01


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_decode_fit_recovers_known_coefficients(seed: int) -> None:
    got = fit_decode(decode_samples(seed, 400, noise=0.02), FAR_PRIOR)
    assert max(rel(got, TRUE_DECODE)) < 0.05


def test_relative_weighting_is_better_on_small_latencies() -> None:
    # short single prompts: where an absolute-error fit pays for fitting the long prefills
    probe = [PrefillSample((n,), predict_prefill(TRUE_PREFILL, (n,))) for n in (4, 8, 16, 32, 64)]
    weighted, plain = [], []
    for seed in range(10):
        samples = prefill_samples(seed, 200, noise=0.05, log_lengths=True)
        weighted.append(prediction_error(fit_prefill(samples, FAR_PRIOR), probe))
        plain.append(prediction_error(fit_prefill(samples, FAR_PRIOR, relative=False), probe))
    assert np.mean(weighted) < 0.5 * np.mean(plain)
    assert np.mean(weighted) < 0.015


def test_coefficients_are_never_negative() -> None:
    # a true negative intercept: unconstrained least squares would return a < 0
    samples = [PrefillSample((n,), 1e-4 * n - 0.005) for n in range(100, 2000, 50)]
    got = fit_prefill(samples, FAR_PRIOR)
    assert got[0] == 0.0 and got[1] > 0.0 and got[2] >= 0.0
    assert prediction_error(got, samples) < 0.1


@pytest.mark.parametrize(
    ("samples", "why"),
    [
        ([PrefillSample((100,), 0.02)] * 7, "too few"),
        ([PrefillSample((n,), 0.01 + 1e-4 * n) for n in range(10, 17)], "7 usable < 8"),
        ([PrefillSample((50, 50), 0.02), PrefillSample((), 0.02)] * 2, "too few, one empty"),
        ([PrefillSample((n,), 0.0) for n in range(10, 60)], "no usable seconds"),
        ([PrefillSample((n,), -1.0) for n in range(10, 60)], "negative seconds"),
    ],
)
def test_prefill_falls_back_to_the_prior(samples: list[PrefillSample], why: str) -> None:
    assert fit_prefill(samples, TRUE_PREFILL) == TRUE_PREFILL, why


def test_one_prompt_length_follows_the_data_and_splits_as_the_prior_does() -> None:
    # every prompt 100 tokens: a, b and c cannot be told apart. The old fit gave up (the prior);
    # an unregularised one picks a corner (all of it in a, or in b). Now the data fix the total at
    # 100 tokens and the prior's shape splits it: nothing collapses to zero.
    samples = [PrefillSample((100,), 0.05) for _ in range(40)]
    prior: Coeffs = (0.005, 1e-4, 1e-9)
    got = fit_prefill(samples, prior)
    assert predict_prefill(got, (100,)) == pytest.approx(0.05, rel=1e-3)
    level = got[0] / prior[0]
    assert level == pytest.approx(0.05 / predict_prefill(prior, (100,)), rel=1e-3)
    assert rel(got, tuple(level * p for p in prior)) == pytest.approx([0, 0, 0], abs=1e-3)


def test_one_batch_size_follows_the_data_and_splits_as_the_prior_does() -> None:
    samples = [
        DecodeSample(total, 4, predict_decode(TRUE_DECODE, total, 4)) for total in range(100, 5000, 100)
    ]
    prior: Coeffs = (0.01, 1e-6, 1e-3)
    got = fit_decode(samples, prior)
    # b' is seen (the context varies); a' + 4 c' is seen; the ridge splits it near the prior's
    # a' : c' (the nearest point of the line a' + 4 c' = seen to the prior's shape), no corner
    assert got[1] == pytest.approx(TRUE_DECODE[1], rel=1e-3)
    assert got[0] + 4 * got[2] == pytest.approx(TRUE_DECODE[0] + 4 * TRUE_DECODE[2], rel=1e-3)
    assert 0.5 < (got[0] / got[2]) / (prior[0] / prior[2]) < 2.0


@pytest.mark.parametrize("factor", [0.1, 0.5, 2.0, 10.0])
@pytest.mark.parametrize("shape", ["same", "different"])
def test_a_prior_far_from_the_truth_does_not_hold_the_fit(factor: float, shape: str) -> None:
    """The quarter-of-the-prior floor kept an engine 4x faster than its profile from being learnt;
    the ridge toward the prior costs well under 1 % with a few hundred clean samples, whether the
    prior is the truth scaled (an engine slower or faster than its profile) or not."""
    skew = (1.0, 1.0, 1.0) if shape == "same" else (3.0, 0.5, 4.0)
    prior_p = tuple(factor * t * k for t, k in zip(TRUE_PREFILL, skew, strict=True))
    prior_d = tuple(factor * t * k for t, k in zip(TRUE_DECODE, skew, strict=True))
    got_p = fit_prefill(prefill_samples(4, 300, noise=0.0), prior_p)  # type: ignore[arg-type]
    got_d = fit_decode(decode_samples(4, 300, noise=0.0), prior_d)  # type: ignore[arg-type]
    assert max(rel(got_p, TRUE_PREFILL)) < 0.01
    assert max(rel(got_d, TRUE_DECODE)) < 0.01
    noisy = fit_prefill(prefill_samples(4, 300, noise=0.05), prior_p)  # type: ignore[arg-type]
    assert max(rel(noisy, TRUE_PREFILL)[:2]) < 0.1


def test_mixed_steps_lose_their_decode_share() -> None:
    # prompts that ran beside decodes: the step also paid b'*context + c'*B for them
    rng = np.random.default_rng(3)
    samples = []
    for _ in range(200):
        n, batch = int(rng.integers(4, 2020)), int(rng.integers(0, 64))
        context = batch * int(rng.integers(50, 1500))
        step = predict_prefill(TRUE_PREFILL, (n,)) + TRUE_DECODE[1] * context + TRUE_DECODE[2] * batch
        samples.append(PrefillSample((n,), step, context, batch))
    got = fit_prefill(samples, FAR_PRIOR, decode=TRUE_DECODE)
    assert max(rel(got, TRUE_PREFILL)) < 1e-3
    # without decode coefficients the mixed samples are left out, not misread
    assert fit_prefill([s for s in samples if s.decode_batch], FAR_PRIOR) == FAR_PRIOR
    model = LatencyModel.from_prior(FAR_PRIOR, FAR_PRIOR)
    for sample in samples:
        model = model.observe_prefill(sample)
    assert model.refit().prefill == fit_prefill([s for s in samples if not s.decode_batch], FAR_PRIOR)
    for step in decode_samples(3, 100, noise=0.0):
        model = model.observe_decode(step)
    refit = model.refit()
    assert max(rel(refit.decode, TRUE_DECODE)) < 1e-3 and max(rel(refit.prefill, TRUE_PREFILL)) < 1e-3
    assert refit.prefill_error() < 1e-3


def test_unusable_samples_are_ignored_not_fatal() -> None:
    good = decode_samples(5, 100, noise=0.0)
    bad = [DecodeSample(100, 1, math.nan), DecodeSample(100, 0, 0.01), DecodeSample(100, 1, -0.01)]
    assert max(rel(fit_decode(good + bad, FAR_PRIOR), TRUE_DECODE)) < 1e-6


@pytest.mark.parametrize(
    ("coeffs", "samples", "expected"),
    [
        ((1.0, 0.0, 0.0), [PrefillSample((5,), 1.0)], 0.0),
        ((1.0, 0.0, 0.0), [PrefillSample((5,), 2.0)], 0.5),
        # a + b*sum + c*sum of squares = 0.5 + 0.1*3 + 0.01*5 = 0.85 vs 1.0
        ((0.5, 0.1, 0.01), [PrefillSample((1, 2), 1.0)], 0.15),
        # a' + b'*L + c'*B = 0.1 + 0.001*100 + 0.05*2 = 0.3 vs 0.2 -> 0.5; and vs 0.3 -> 0
        ((0.1, 0.001, 0.05), [DecodeSample(100, 2, 0.2), DecodeSample(100, 2, 0.3)], 0.25),
        ((1.0, 0.0, 0.0), [PrefillSample((5,), 0.0)], math.nan),
        ((1.0, 0.0, 0.0), [], math.nan),
    ],
)
def test_prediction_error(
    coeffs: Coeffs, samples: list[PrefillSample | DecodeSample], expected: float
) -> None:
    got = prediction_error(coeffs, samples)
    assert math.isnan(got) if math.isnan(expected) else got == pytest.approx(expected)


def test_latency_model_rings_and_refit() -> None:
    prior_prefill: Coeffs = (0.05, 2e-4, 0.0)
    prior_decode: Coeffs = (0.02, 5e-6, 0.0)
    model = LatencyModel.from_prior(prior_prefill, prior_decode, capacity=64)
    assert model.refit() == model  # no samples: priors stay
    samples = prefill_samples(9, 100, noise=0.01)
    steps = decode_samples(9, 100, noise=0.01)
    start = model
    for sample in samples:
        model = model.observe_prefill(sample)
    for step in steps:
        model = model.observe_decode(step)
    assert start.prefill_samples == () and start.decode_samples == ()  # values, not mutation
    assert model.prefill_samples == tuple(samples[-64:])
    assert model.decode_samples == tuple(steps[-64:])
    assert model.prefill == prior_prefill  # observing alone does not refit
    fitted = model.refit()
    assert fitted.prior_prefill == prior_prefill
    assert max(rel(fitted.decode, TRUE_DECODE)) < 0.1
    assert fitted.prefill_error() < 0.02 < model.prefill_error()
    assert fitted.decode_error() < 0.02 < model.decode_error()
    assert fitted.predict_decode(1000, 4) == pytest.approx(predict_decode(fitted.decode, 1000, 4))
    assert fitted.predict_prefill([10, 20]) == pytest.approx(predict_prefill(fitted.prefill, [10, 20]))


def test_prefills_of_cached_prompts_do_not_set_the_per_token_floor() -> None:
    """A prefill of no uncached token (the prompt found whole in the prefix cache) has a "slope"
    of its whole time: 12 of them at 30 ms beside 8 of 1000 tokens at 130 ms put b at 6e-4, six
    times the 1e-4 the data show."""
    for cached_whole in (0, 1, 3):  # (a predicted whole hit may leave a token or three)
        samples = [PrefillSample((cached_whole,), 0.03)] * 12 + [PrefillSample((1000,), 0.13)] * 8
        a, b, _ = fit_prefill(samples, TRUE_PREFILL)
        assert b == pytest.approx(1e-4, rel=0.05) and a == pytest.approx(0.03, rel=0.05), cached_whole
    # none of a block or more: no slope to floor by, the fit stands (flat data: b from the ridge)
    flat = [PrefillSample((n,), 0.03) for n in (0, 1, 2, 3) * 5]
    assert fit_prefill(flat, TRUE_PREFILL)[1] < TOKEN_COST_FLOOR * 0.03 / 3


def test_flat_prefills_keep_a_per_token_cost_from_the_data() -> None:
    # the same 0.5 s whatever the prompt length (what queueing looked like in the old samples): a
    # zero per-token cost would make the eq.(5) budget unbounded. The floor comes from the data
    # (a share of the median slope seconds / tokens), not from the prior, so it cannot pin a fit.
    flat = [PrefillSample((n,), 0.5) for n in range(100, 2100, 100)]
    a, b, c = fit_prefill(flat, TRUE_PREFILL)
    slopes = sorted(0.5 / n for n in range(100, 2100, 100))
    assert b == pytest.approx(TOKEN_COST_FLOOR * (slopes[9] + slopes[10]) / 2)
    assert a == pytest.approx(0.5, rel=0.01) and c == 0.0
    assert token_budget(1.0, 0.1, 0.02, a, b) < UNBOUNDED_TOKENS
    # on real prefills it does not bind
    assert fit_prefill(prefill_samples(1, 200, noise=0.0), TRUE_PREFILL)[1] == pytest.approx(TRUE_PREFILL[1])
    with pytest.raises(ValueError):
        LatencyModel(TRUE_PREFILL, TRUE_DECODE, TRUE_PREFILL, TRUE_DECODE, prior_spread=0.0)


def test_latency_model_refits_to_the_prior_when_the_ring_is_too_small() -> None:
    model = LatencyModel.from_prior(TRUE_PREFILL, TRUE_DECODE, capacity=4)
    for sample in prefill_samples(1, 20, noise=0.0):
        model = model.observe_prefill(sample)
    assert len(model.prefill_samples) == 4
    assert model.refit().prefill == TRUE_PREFILL
    with pytest.raises(ValueError):
        LatencyModel.from_prior(TRUE_PREFILL, TRUE_DECODE, capacity=0)


@pytest.mark.parametrize(
    ("ttft", "tpot", "e_d", "a", "b", "expected"),
    [
        # (2*0.5 - 2*0.25 - 0.5*0.5) / (0.001*0.5) = 0.25 / 0.0005
        (2.0, 0.5, 0.25, 0.5, 0.001, 500),
        # medical_qa (Table 1) on a 7B worker: (0.35 - 0.021 - 0.0075) / 4e-5 = 8037.5
        (0.7, 0.5, 0.03, 0.015, 8e-5, 8037),
        # gsm8k: (0.14 - 0.7*0.05 - 0.015*0.2) / (8e-5*0.2) = 0.102 / 1.6e-5 = 6375
        (0.7, 0.2, 0.05, 0.015, 8e-5, 6375),
        # no decode running: (1*0.1 - 0.02*0.1) / (1e-4*0.1) = 0.098 / 1e-5 = 9800
        (1.0, 0.1, 0.0, 0.02, 1e-4, 9800),
        # infeasible: decoding already takes all of TPOT, or more
        (1.0, 0.05, 0.05, 0.01, 1e-4, 0),
        (1.0, 0.04, 0.05, 0.01, 1e-4, 0),
        # infeasible: the intercept alone breaks TTFT (0.01 - 0.005 - 0.02 < 0)
        (0.1, 0.1, 0.05, 0.2, 1e-4, 0),
        # exactly zero slack: zero tokens
        (1.0, 0.5, 0.25, 0.5, 1e-4, 0),
        # unbounded: no per-token cost, or no TTFT
        (1.0, 0.5, 0.1, 0.01, 0.0, UNBOUNDED_TOKENS),
        (math.inf, 0.5, 0.1, 0.01, 1e-4, UNBOUNDED_TOKENS),
        (1.0, 0.0, 0.0, 0.01, 1e-4, 0),
        # no TPOT to keep: the TTFT alone, (1 - 0.02) / 1e-4 (the formula's inf - inf gave 0)
        (1.0, math.inf, 0.05, 0.02, 1e-4, 9800),
        (0.01, math.inf, 0.0, 0.02, 1e-4, 0),
        (math.inf, math.inf, 0.0, 0.02, 1e-4, UNBOUNDED_TOKENS),
    ],
)
def test_token_budget(ttft: float, tpot: float, e_d: float, a: float, b: float, expected: int) -> None:
    assert token_budget(ttft, tpot, e_d, a, b) == expected


def test_token_budget_is_the_largest_n_satisfying_eq7() -> None:
    # appendix B: E_P * TPOT / (TPOT - E_d) <= TTFT with E_P = a + b*n
    rng = random.Random(11)
    for _ in range(500):
        ttft, tpot = rng.uniform(0.2, 20), rng.uniform(0.05, 1.0)
        e_d, a, b = rng.uniform(0, tpot * 0.9), rng.uniform(0, 0.05), rng.uniform(1e-5, 1e-3)
        n = token_budget(ttft, tpot, e_d, a, b)
        if n == 0:
            continue

        def amortised(tokens: int) -> float:
            return (a + b * tokens) * tpot / (tpot - e_d)  # noqa: B023

        assert amortised(n) <= ttft * (1 + 1e-9)
        assert amortised(n + 1) > ttft


@pytest.mark.parametrize(
    ("now", "e_p", "e_d", "min_tpot", "expected"),
    [
        # relax = 0.1 - 0.05 = 0.05: 0.2/0.05 = 4 decode steps of 0.05 amortise the prefill
        (10.0, 0.2, 0.05, 0.1, 10.4),
        # relax = 0.5 - 0.25 = 0.25: 100 + 1 + (1/0.25)*0.25
        (100.0, 1.0, 0.25, 0.5, 102.0),
        # nothing decoding: just the prefill
        (5.0, 0.3, 0.0, 0.1, 5.3),
        # nothing to amortise
        (5.0, 0.0, 0.2, 0.1, 5.0),
        # decoding never catches up with the tightest TPOT
        (5.0, 0.3, 0.1, 0.1, math.inf),
        (5.0, 0.3, 0.2, 0.1, math.inf),
    ],
)
def test_maturity_time(now: float, e_p: float, e_d: float, min_tpot: float, expected: float) -> None:
    assert maturity_time(now, e_p, e_d, min_tpot) == pytest.approx(expected)


def test_maturity_time_rejects_negative_durations() -> None:
    with pytest.raises(ValueError):
        maturity_time(0.0, -0.1, 0.0, 0.1)


def test_short_prompts_alone_leave_the_prior_s_per_token_cost_at_their_level() -> None:
    """Prompts of 1-15 tokens only: nothing to floor the per-token cost by, and the fit set it to
    0 in some draws; a 4,000-token prompt was then predicted at its fixed cost and the eq.(5)
    budget was unbounded. The prior's slope holds, at the level the samples run at against it."""
    for seed in range(20):
        rng = random.Random(seed)
        samples = []
        for _ in range(64):
            n = rng.randint(1, 15)
            samples.append(PrefillSample((n,), (0.025 + 1e-4 * n) * rng.uniform(0.95, 1.05)))
        a, b, _ = fit_prefill(samples, TRUE_PREFILL)
        assert b >= TRUE_PREFILL[1], (seed, b)  # (the prior's, at a level above 1 here)
        assert token_budget(1.0, 0.1, 0.02, a, b) < UNBOUNDED_TOKENS
    constant = [PrefillSample((n,), 0.03) for n in range(1, 16)] * 4
    assert fit_prefill(constant, TRUE_PREFILL)[1] > 0


@pytest.mark.parametrize("seconds", [0.0005, 0.002, 0.005])
def test_one_far_too_fast_sample_is_left_out_not_followed(seconds: float) -> None:
    """A prompt the engine had cached, or a prefill answered elsewhere, times far below the rest;
    weighted 1/y, it pulled the first pass onto itself, every residual then sat far from zero,
    none was kept and the dragged fit stood (a 2,000-token prefill predicted 16x too fast)."""
    samples = [*prefill_samples(4, 200, noise=0.05), PrefillSample((2000,), seconds)]
    got = fit_prefill(samples, FAR_PRIOR)
    assert predict_prefill(got, (2000,)) == pytest.approx(predict_prefill(TRUE_PREFILL, (2000,)), rel=0.1)
    steps = [*decode_samples(4, 300, noise=0.05), DecodeSample(50_000, 32, seconds)]
    fitted = fit_decode(steps, FAR_PRIOR)
    assert predict_decode(fitted, 50_000, 32) == pytest.approx(
        predict_decode(TRUE_DECODE, 50_000, 32), rel=0.1
    )
