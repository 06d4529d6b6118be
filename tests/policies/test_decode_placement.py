"""Decode-stage placement (two-stage P/D): literal tables over the fleet of the moment."""

from __future__ import annotations

import pytest

from policies.api import EngineSnapshot, Role
from policies.decode_placement import (
    DecodeCandidate,
    DecodeChoice,
    DecodeDemand,
    DecodePlacementParams,
    place_decode,
)
from policies.latency import LatencyCoefficients

#: 7B-class eq.(2): 12 ms per step, 4e-8 s per context token, 0.1 ms per sequence
COEFFS = LatencyCoefficients(0.025, 1e-4, 2e-9, 0.012, 4e-8, 1e-4)
#: a decode engine slow enough that its load decides TPOT: 10 ms per sequence in the batch
SLOW = LatencyCoefficients(0.025, 1e-4, 2e-9, 0.010, 0.0, 0.010)
PARAMS = DecodePlacementParams(transfer_tokens_per_s=10_000.0, transfer_latency_s=0.001)


def cand(
    name: str,
    in_flight: int = 0,
    running_tokens: int = 0,
    transfers: int = 0,
    free_kv: int | None = None,
    coeffs: LatencyCoefficients = COEFFS,
) -> DecodeCandidate:
    snap = EngineSnapshot(name, "m", Role.DECODE, in_flight=in_flight, running_tokens=running_tokens)
    return DecodeCandidate(snap, coeffs, transfers, free_kv)


def demand(prompt: int = 1000, output: int = 100, tpot: float = 0.1) -> DecodeDemand:
    return DecodeDemand("r1", prompt, output, tpot, source_engine="p0")


CASES: list[
    tuple[str, DecodeDemand, list[DecodeCandidate], DecodePlacementParams, str | None, bool | None]
] = [
    ("no candidate", demand(), [], PARAMS, None, None),
    ("idle beats busy", demand(), [cand("d0", 40, 40_000), cand("d1", 0, 0)], PARAMS, "d1", True),
    (
        "fewer running tokens wins",
        demand(),
        [cand("d0", 5, 90_000), cand("d1", 5, 10_000)],
        PARAMS,
        "d1",
        True,
    ),
    ("equal engines: fleet order", demand(), [cand("d0", 3, 300), cand("d1", 3, 300)], PARAMS, "d0", True),
    # the link into d1 carries 4 transfers: 1000 tokens at 10k tokens/s x 5 = 0.5 s late start
    (
        "transfers in flight count",
        demand(),
        [cand("d1", 4, 0, transfers=4), cand("d0", 2, 2000)],  # (transfers are reserved: in flight)
        PARAMS,
        "d0",
        True,
    ),
    # d0 has KV for 500 tokens, the request needs 1,100
    (
        "KV room respected",
        demand(),
        [cand("d0", 0, 0, free_kv=500), cand("d1", 50, 50_000, free_kv=10_000)],
        PARAMS,
        "d1",
        True,
    ),
    ("unknown KV room fits", demand(), [cand("d0", 0, 0, free_kv=None)], PARAMS, "d0", True),
    # SLOW engines: step = 10 ms + 10 ms x batch; TPOT 0.1 s allows a batch of 9
    (
        "TPOT-feasible over less loaded link",
        demand(tpot=0.1),
        [cand("d0", 12, 0, coeffs=SLOW), cand("d1", 5, 0, transfers=9, coeffs=SLOW)],
        PARAMS,
        "d1",
        True,
    ),
    (
        "nothing meets TPOT: least bad",
        demand(tpot=0.05),
        [cand("d0", 30, 0, coeffs=SLOW), cand("d1", 20, 0, coeffs=SLOW)],
        PARAMS,
        "d1",
        False,
    ),
    (
        "nothing fits KV: smallest shortfall, never None",
        demand(),
        [cand("d0", 0, 0, free_kv=100), cand("d1", 0, 0, free_kv=900)],
        PARAMS,
        "d1",
        False,
    ),
    (
        "KV fit beats TPOT miss without fit",
        demand(tpot=0.05),
        [cand("d0", 0, 0, free_kv=10, coeffs=SLOW), cand("d1", 30, 0, free_kv=10_000, coeffs=SLOW)],
        PARAMS,
        "d1",
        False,
    ),
    (
        "decode token budget",
        demand(prompt=1000),
        [cand("d0", 1, 3_500), cand("d1", 9, 2_000)],
        DecodePlacementParams(10_000.0, 0.001, max_decode_batch_tokens=4_000),
        "d1",
        True,
    ),
]


@pytest.mark.parametrize(
    ("demand_", "candidates", "params", "engine", "feasible"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_place_decode(
    demand_: DecodeDemand,
    candidates: list[DecodeCandidate],
    params: DecodePlacementParams,
    engine: str | None,
    feasible: bool | None,
) -> None:
    choice = place_decode(demand_, candidates, params)
    if engine is None:
        assert choice is None
        return
    assert choice is not None
    assert (choice.engine_id, choice.feasible) == (engine, feasible)


def test_choice_reports_its_predictions() -> None:
    choice = place_decode(demand(prompt=1000), [cand("d0", 3, 2000, transfers=1)], PARAMS)
    # eq.(2): 0.012 + 4e-8 x (2000 + 1000) + 1e-4 x 4; transfer 1 ms + 0.1 s x 2
    assert choice == DecodeChoice("d0", pytest.approx(0.012 + 4e-8 * 3000 + 4e-4), pytest.approx(0.201), True)


def test_spreads_load_over_the_pool() -> None:
    """Placing one request after another, each added to the chosen engine's batch, fills the pool
    evenly (a router sending everything to one decode worker: vllm-project/router PR#198, smg#1714)."""
    load = {f"d{i}": [0, 0] for i in range(4)}
    for n in range(400):
        prompt = 200 + (n * 37) % 900
        cands = [cand(e, inflight, tokens) for e, (inflight, tokens) in load.items()]
        choice = place_decode(DecodeDemand(f"r{n}", prompt, 50, 0.5), cands, PARAMS)
        assert choice is not None and choice.feasible
        load[choice.engine_id][0] += 1
        load[choice.engine_id][1] += prompt
    counts = [inflight for inflight, _ in load.values()]
    assert max(counts) - min(counts) <= 3, counts


def test_deterministic() -> None:
    cands = [cand("d0", 2, 500), cand("d1", 2, 500), cand("d2", 1, 900)]
    choices = {place_decode(demand(), cands, PARAMS) for _ in range(5)}
    assert len(choices) == 1


def _with_tight(candidate: DecodeCandidate, tightest: float | None) -> DecodeCandidate:
    return DecodeCandidate(
        candidate.engine,
        candidate.coefficients,
        candidate.transfers_in_flight,
        candidate.free_kv_tokens,
        tightest_running_tpot_s=tightest,
    )


def test_a_loose_request_does_not_push_a_tight_stream_past_its_target() -> None:
    """SLOW steps 10 ms per sequence: 'tight' runs 3 streams with a 45 ms target (40 ms now, 50 ms
    with one more), 'loose' runs 4 streams of 200 ms targets (50 ms now). A 250 ms request fits
    both by its own target; only 'loose' keeps every running stream's target."""
    tight = _with_tight(cand("tight", in_flight=3, coeffs=SLOW), 0.045)
    loose = _with_tight(cand("loose", in_flight=4, coeffs=SLOW), 0.200)
    choice = place_decode(demand(prompt=100, tpot=0.25), [tight, loose], PARAMS)
    assert choice is not None and choice.engine_id == "loose" and choice.feasible
    # without the running streams' targets the emptier 'tight' engine would have won
    plain = place_decode(
        demand(prompt=100, tpot=0.25), [cand("tight", 3, coeffs=SLOW), cand("loose", 4, coeffs=SLOW)], PARAMS
    )
    assert plain is not None and plain.engine_id == "tight"


def test_with_nothing_feasible_overload_stays_where_targets_are_missed_already() -> None:
    """A 30 ms request fits nowhere. 'healthy' meets its streams' 45 ms now and would not with it;
    'missing' already runs past its streams' 45 ms: the request goes there, though it has less slack."""
    healthy = _with_tight(cand("healthy", in_flight=3, coeffs=SLOW), 0.045)
    missing = _with_tight(cand("missing", in_flight=5, coeffs=SLOW), 0.045)
    choice = place_decode(demand(prompt=100, tpot=0.03), [healthy, missing], PARAMS)
    assert choice is not None and choice.engine_id == "missing" and not choice.feasible


def test_least_load_does_not_starve_an_engine_whose_model_is_still_the_prior() -> None:
    """'learnt' decodes 2 streams with a learnt (fast) model; 'prior' is idle, its model the
    pessimistic prior. Both meet the target: least_load (the default) feeds the idle one, so it
    gets the traffic it learns from; most_slack would keep it idle (dynamo#7836)."""
    pessimistic = LatencyCoefficients(0.025, 1e-4, 2e-9, 0.030, 4e-8, 1e-3)
    learnt = cand("learnt", in_flight=2)
    prior = cand("prior", coeffs=pessimistic)
    default = place_decode(demand(), [learnt, prior], PARAMS)
    assert default is not None and default.engine_id == "prior" and default.feasible
    slack = place_decode(
        demand(), [learnt, prior], DecodePlacementParams(10_000.0, 0.001, prefer="most_slack")
    )
    assert slack is not None and slack.engine_id == "learnt"


def test_an_engine_judged_infeasible_by_its_prior_alone_is_judged_by_the_pool_s_learnt_model() -> None:
    """Feasibility ranks before load: an engine whose pessimistic prior predicts a step past the
    target was never chosen while another was feasible, so it never decoded and never learnt
    (even idle against 150 streams elsewhere). Judged by the pool's learnt model until it has
    samples of its own, it takes its share; learnt, its own model stands."""
    from policies.decode_placement import judged_decode

    pessimistic = LatencyCoefficients(0.025, 1e-4, 2e-9, 0.060, 4e-7, 1e-3)
    tpot = demand(tpot=0.05)
    busy = cand("learnt", in_flight=150, running_tokens=150 * 1000)
    as_prior = cand("prior", coeffs=pessimistic)
    starved = place_decode(tpot, [busy, as_prior], PARAMS)
    assert starved is not None and starved.engine_id == "learnt"  # (the prior alone: infeasible)
    own = (pessimistic.a_d, pessimistic.b_d, pessimistic.c_d)
    learnt = (COEFFS.a_d, COEFFS.b_d, COEFFS.c_d)
    judged = judged_decode(own, False, [learnt, (0.5, 0.0, 0.0)], 1000)
    assert judged == learnt  # (the pool's fastest for this request)
    fair = cand("prior", coeffs=LatencyCoefficients(pessimistic.a, pessimistic.b, pessimistic.c, *judged))
    chosen = place_decode(tpot, [busy, fair], PARAMS)
    assert chosen is not None and chosen.engine_id == "prior" and chosen.feasible
    assert judged_decode(own, True, [learnt], 1000) == own  # its own, once learnt
    assert judged_decode(own, False, [], 1000) == own  # nothing learnt anywhere: the prior
