"""The gateway learns each engine's latency model from what it sees, whatever its prior.

Offline, with the cluster simulator: the engines run the qwen-7b profile at ``engine_speed`` times
its speed while the gateway is handed the profile itself as its prior, so the prior is ``speed``
times the truth (an engine 10x slower than its profile: a prior at 0.1x). Learning runs through the gateway's own code (the fleet's token stream and
scrapes, :class:`~gateway.dispatch.latency_learner.LatencyLearner`), as it does live.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache

import pytest

from gateway import metrics
from gateway.dispatch import latency_learner
from gateway.experiments.workload import RequestSpec
from gateway.sim.engine import SimRequest
from gateway.sim.profiles import load_profile
from gateway.simulator.capacity import engine_capacity
from gateway.simulator.disturbance import Disturbance
from gateway.simulator.gateway_node import engine_prompt
from gateway.simulator.scenario import Scenario, Simulation, workload_for
from policies.latency_fit import Coeffs, LatencyModel
from policies.latency_samples import TRUSTED

PROFILE = load_profile("qwen-7b").latency
#: every prefill and decode coefficient the test holds to 20 %: prefill a and b, decode a', b', c'.
#: (Prefill c, the quadratic term, is < 3 % of any prefill in this workload and not identifiable:
#: the gateway's prompt-length estimate, 6 tokens short of the simulated chat template, moves
#: more than that; it is reported, not held.)
CHECKED = (("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1), ("decode", 2))
TOLERANCE = 0.20


@cache
def capacity(speed: float) -> float:
    return engine_capacity("hyperflexis-4task", speed=speed)


def scenario(speed: float, policy: str = "least-load", load: float = 0.6, requests: int = 200) -> Scenario:
    """``requests`` requests at ``load`` times the two engines' capacity (moderate by default)."""
    return Scenario(
        "hyperflexis-4task",
        qps=load * 2 * capacity(speed),
        policy=policy,
        engines=2,
        requests=requests,
        seed=1,
        engine_speed=speed,
    )


def learnt(sim: Simulation) -> dict[str, tuple[Coeffs, Coeffs]]:
    """Every engine's coefficients after one more scrape (the monitor's next tick confirms the
    samples of the interval the run ended in)."""
    gateway = sim.gateway
    for node in sim.nodes:
        gateway.fleet.record_state(node.engine_id, node.state(), sim.clock.now)
    return {node.engine_id: gateway.slo.coefficients(node.engine_id) for node in sim.nodes}


def ratios(coefficients: tuple[Coeffs, Coeffs], speed: float) -> dict[tuple[str, int], float]:
    """Fitted / true for every coefficient (the truth: the profile's, divided by the speed)."""
    prefill, decode = coefficients
    truth = {"prefill": PROFILE.prefill, "decode": PROFILE.decode}
    fitted = {"prefill": prefill, "decode": decode}
    return {
        (stage, i): fitted[stage][i] / (truth[stage][i] / speed)
        for stage in ("prefill", "decode")
        for i in range(3)
    }


@pytest.mark.parametrize("policy", ["least-load", "hyperflexis"])
@pytest.mark.parametrize("speed", [0.1, 0.5, 2.0, 10.0])  # the prior is 0.1x, 0.5x, 2x, 10x the truth
def test_every_engine_is_learnt_within_20_percent_after_200_completions(speed: float, policy: str) -> None:
    # (240 sent for 200 completions: on engines 10x slower than the prior, HyperFlexis refuses a
    # few after their queue timeout at this load: eq.(5)'s fixed cost alone exceeds the budget's
    # horizon there, so each turn takes one request and late ones are not backfilled)
    sim = Simulation(scenario(speed, policy, requests=240))
    result = sim.run()
    assert sum(o.status == 200 for o in result.outcomes) >= 200
    for engine, coefficients in learnt(sim).items():
        got = ratios(coefficients, speed)
        off = {key: round(got[key], 3) for key in CHECKED if not abs(got[key] - 1.0) <= TOLERANCE}
        assert not off, f"{engine} at speed {speed}: fitted/true {off}"
        prefill_samples, decode_samples = sim.gateway.slo.latency.sample_counts(engine)
        assert prefill_samples >= 8 and decode_samples >= 8


@pytest.mark.parametrize("policy", ["least-load", "hyperflexis"])
def test_engines_are_learnt_when_their_tokens_and_scrapes_reach_the_gateway_late(policy: str) -> None:
    """20 ms between the engine and the gateway each way back (a loaded gateway reads tokens and
    scrapes late, as this machine's live runs did): compared on the gateway's clock, every prompt
    looked sent during the step before the one that prefilled it, so no prefill sample was ever
    clean and the prior (here half the engines' speed) stayed. The scrapes' round trip gives the
    path's delay, and prompts are placed on the clock their tokens are seen by."""
    speed = 2.0
    delayed = dataclasses.replace(
        scenario(speed, policy, requests=400), disturbances=(Disturbance("relay-delay", 0.0, 1e6, 0.02),)
    )
    sim = Simulation(delayed)
    sim.run()
    for engine, coefficients in learnt(sim).items():
        got = ratios(coefficients, speed)
        off = {key: round(got[key], 3) for key in CHECKED if not abs(got[key] - 1.0) <= TOLERANCE}
        assert not off, f"{engine}: fitted/true {off}"
        assert sim.gateway.slo.latency.sample_counts(engine)[0] >= 50


def test_a_relay_delay_that_ends_leaves_no_shift_behind() -> None:
    """Tokens 20 ms late for the first 14 s only: once the health checks come back at once the
    path is 0 again, or every idle engine's prefill after the window would read 20 ms short."""
    speed = 2.0
    window = dataclasses.replace(
        scenario(speed, load=0.1, requests=300), disturbances=(Disturbance("relay-delay", 0.0, 14.0, 0.02),)
    )
    sim = Simulation(window)
    sim.run()
    assert sim.clock.now > 20.0  # (the run goes well past the window)
    for engine, coefficients in learnt(sim).items():
        assert sim.gateway.slo.latency._steps[engine].path_s == 0.0
        got = ratios(coefficients, speed)
        off = {key: round(got[key], 3) for key in CHECKED if not abs(got[key] - 1.0) <= TOLERANCE}
        assert not off, f"{engine}: fitted/true {off}"


def test_without_learning_the_prior_would_be_off_by_the_speed() -> None:
    """The check above can fail: the same run with nothing learnt leaves the prior, 10x off."""
    sim = Simulation(scenario(0.1))
    sim.gateway.fleet.token_observer = None  # the learner sees no token
    sim.run()
    for coefficients in learnt(sim).values():
        assert all(r == pytest.approx(0.1) for r in ratios(coefficients, 0.1).values())


def _same_lengths(specs: list[RequestSpec]) -> list[RequestSpec]:
    """Every prompt 200 tokens and every answer 32, one at a time (each arrives after the one
    before has ended): one prompt length, one decode batch size."""
    return [
        dataclasses.replace(s, at=i * 2.0, prompt_tokens=200, output_tokens=32, segments=())
        for i, s in enumerate(specs)
    ]


@pytest.mark.parametrize("skewed", [False, True])
def test_degenerate_traffic_does_not_collapse_the_model(skewed: bool) -> None:
    """One prompt length and a decode batch of one: eq.(1)'s a, b, c and eq.(2)'s a', c' cannot be
    told apart. The fit keeps what the data show (the prefill of that prompt and the decode step at
    batch one, within 1 %) and splits the rest as the prior does, whether the prior is the truth
    scaled or also wrong in shape: no coefficient goes to zero and none runs away, where an
    unregularised fit would pick a corner and the old one fell back to the prior entirely."""
    speed = 0.5
    base = scenario(speed, requests=60)
    sim = Simulation(base, _same_lengths(workload_for(base)))
    if skewed:  # a prior 2x off overall and off in shape too
        prior_p = tuple(2 * c * k for c, k in zip(PROFILE.prefill, (3.0, 0.5, 4.0), strict=True))
        prior_d = tuple(2 * c * k for c, k in zip(PROFILE.decode, (0.5, 3.0, 4.0), strict=True))
        latency = sim.gateway.slo.latency
        for engine in latency.models:
            latency.models[engine] = LatencyModel.from_prior(prior_p, prior_d)  # type: ignore[arg-type]
    sim.run()
    prompt = len(engine_prompt(sim.specs[0]))
    estimate = prompt - 6  # the gateway's estimate of the chat prompt (see CHECKED)
    truth_p = tuple(c / speed for c in PROFILE.prefill)
    truth_d = tuple(c / speed for c in PROFILE.decode)
    for engine, (prefill, decode) in learnt(sim).items():
        assert sim.gateway.slo.latency.sample_counts(engine)[0] >= 20
        seen = prefill[0] + prefill[1] * estimate + prefill[2] * estimate**2
        assert seen == pytest.approx(truth_p[0] + truth_p[1] * prompt + truth_p[2] * prompt**2, rel=0.01)
        for context in (prompt - 6, prompt + 26):  # the answer's first and last step
            step = decode[0] + decode[1] * context + decode[2]
            assert step == pytest.approx(truth_d[0] + truth_d[1] * (context + 6) + truth_d[2], rel=0.01)
        for got, true in (*zip(prefill, truth_p, strict=True), *zip(decode, truth_d, strict=True)):
            assert 0.1 * true < got < 10 * true, (prefill, decode)


def _with_foreign_work(speed: float) -> Simulation:
    """A run in which another client keeps 64 long decodes on engine 0 from the start: they share
    its steps, but the gateway sees neither their tokens nor their batch."""
    sim = Simulation(scenario(speed))
    node = sim.nodes[0]
    for i in range(64):
        sim.clock.at(0.0, node.add, SimRequest(f"other-{i}", list(range(1, 200)), 2000, 0.0, ignore_eos=True))
    return sim


def test_work_the_gateway_did_not_see_is_not_learnt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own counters (more steps and tokens than the gateway saw) refute those
    intervals, so engine 0 keeps its prior rather than learning steps it misreads; engine 1 is
    learnt as before. Without the check, engine 0's decode model would be far off."""
    speed = 0.5
    before = _refuted("sim-0")
    sim = _with_foreign_work(speed)
    sim.run()
    coefficients = learnt(sim)
    assert _refuted("sim-0") > before
    assert sim.gateway.slo.latency.sample_counts("sim-0") == (0, 0)
    assert all(r == pytest.approx(speed) for r in ratios(coefficients["sim-0"], speed).values())
    got = ratios(coefficients["sim-1"], speed)
    assert all(abs(got[key] - 1.0) <= TOLERANCE for key in CHECKED)

    monkeypatch.setattr(latency_learner, "check_interval", lambda *_: TRUSTED)
    unchecked = _with_foreign_work(speed)
    unchecked.run()
    misread = ratios(learnt(unchecked)["sim-0"], speed)
    assert misread[("decode", 0)] > 1.0 + TOLERANCE  # 64 unseen sequences in every step


def _refuted(engine: str) -> float:
    total = 0.0
    for stage in ("prefill", "decode"):
        value = metrics.REGISTRY.get_sample_value(
            "slogate_latency_samples_total", {"engine": engine, "stage": stage, "outcome": "refuted"}
        )
        total += value or 0.0
    return total


def test_learning_figures_table() -> None:
    """The figures the issue asks for, printed (``pytest -s``): fitted / true per coefficient."""
    lines = [
        "| prior / truth | policy | engine | a | b | c | a' | b' | c' |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for speed in (0.1, 0.5, 2.0, 10.0):
        sim = Simulation(scenario(speed, "hyperflexis"))
        sim.run()
        for engine, coefficients in learnt(sim).items():
            got = ratios(coefficients, speed)
            cells = " | ".join(f"{got[(stage, i)]:.3f}" for stage in ("prefill", "decode") for i in range(3))
            lines.append(f"| {speed:g}x | hyperflexis | {engine} | {cells} |")
            assert all(math.isfinite(v) for v in got.values())
    print("\n".join(lines))
