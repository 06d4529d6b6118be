"""P/D in the offline simulator: prefills through the dispatch core, decodes placed when the
prefill ends (two-stage) or paired at dispatch (one-shot RR), KV over each decode engine's link in
FIFO or RMLQ order; and the two commands at smoke scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.experiments.replay import summarize
from gateway.simulator.pd import PdGateway
from gateway.simulator.scenario import Scenario, Simulation
from policies.latency_fit import predict_prefill
from tests.support.strict_json import strict_json


def _scenario(**kw: object) -> Scenario:
    base: dict[str, object] = {
        "workload": "hyperflexis-4task",
        "qps": 20.0,
        "policy": "round-robin",
        "pd": (2, 2),
        "duration_s": 4.0,
        "requests": 80,
        "disaggregation": "always",
    }
    base.update(kw)
    return Scenario(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["two-stage", "one-shot"])
def test_every_request_prefills_on_a_prefill_engine_and_decodes_on_a_decode_engine(mode: str) -> None:
    sim = Simulation(_scenario(pd_mode=mode))
    result = sim.run()
    gateway = sim.gateway
    assert isinstance(gateway, PdGateway)
    assert len(result.outcomes) == 80 and all(o.status == 200 for o in result.outcomes)
    assert {o.engine for o in result.outcomes} <= {"decode-0", "decode-1"}
    # the client's tokens are the decode engine's, all of them (the prefill's token is not relayed)
    assert all(o.tokens == o.spec.output_tokens for o in result.outcomes)
    nodes = {n.engine_id: n.model for n in sim.nodes}
    # each prefill emitted its one token and held the KV; the decode engines generated the rest
    assert nodes["prefill-0"].counters.generation_tokens + nodes["prefill-1"].counters.generation_tokens == 80
    decoded = nodes["decode-0"].counters.generation_tokens + nodes["decode-1"].counters.generation_tokens
    assert decoded == sum(o.tokens for o in result.outcomes)
    assert nodes["decode-0"].link_transfers + nodes["decode-1"].link_transfers == 80
    # every held KV was freed when its transfer ended; no shadow reservation is left
    assert not nodes["prefill-0"].held and not nodes["prefill-1"].held
    assert all(r.in_flight == 0 and not r.unprefilled for r in gateway.fleet.records.values())
    assert result.served_by_engine["prefill-0"] + result.served_by_engine["prefill-1"] == 80
    assert result.cost_units > 0 and set(result.busy_by_engine) == set(nodes)
    # every engine's KV events were read (the prefill engines' kept growing, one event per
    # block stored, and never reached the prefix index)
    assert all(not model.cache.events for model in nodes.values())


def test_one_fleet_with_roles_front_pool_prefill_decode_pool_decode() -> None:
    """The gateway's registry holds both roles: the dispatch core's front pool is the prefill
    engines, the decode stage reads decode_pool (as live)."""
    sim = Simulation(_scenario(requests=10, qps=5.0))
    gateway = sim.gateway
    assert isinstance(gateway, PdGateway)
    fleet = gateway.fleet
    assert fleet.has_prefill_pool("sim-model")
    assert [s.engine_id for s in fleet.candidates("sim-model", 0.0)] == ["prefill-0", "prefill-1"]
    assert [s.engine_id for s in fleet.decode_pool("sim-model", 0.0)] == ["decode-0", "decode-1"]
    sim.run()


def test_decode_placement_uses_learnt_coefficients_and_known_speeds() -> None:
    """A decode engine configured 2x slower (time_scale 0.5) carries that prior into place_decode,
    which then sends it fewer decodes; the engine itself runs 2x slower."""
    sim = Simulation(_scenario(decode_speeds=(1.0, 0.5), requests=120, qps=30.0))
    gateway = sim.gateway
    assert isinstance(gateway, PdGateway)
    fast, slow = gateway.slo.coefficients("decode-0")[1], gateway.slo.coefficients("decode-1")[1]
    assert slow[0] == pytest.approx(2 * fast[0])
    nodes = {n.engine_id: n for n in sim.nodes}
    assert nodes["decode-1"].model.slow_factor == pytest.approx(2.0)
    result = sim.run()
    # every target met, and the slow engine's prior seen: its decode steps are predicted 2x longer
    assert summarize(result.outcomes).attainment == 1.0
    assert gateway.placements["feasible"] == 120


def test_least_load_pairs_at_dispatch_and_counts_its_pairs() -> None:
    result = Simulation(_scenario(pd_mode="one-shot-least-load")).run()
    served = [result.served_by_engine["decode-0"], result.served_by_engine["decode-1"]]
    assert sum(served) == 80 and min(served) >= 30, served


def test_conditional_disaggregation_runs_short_prompts_whole_on_a_decode_engine() -> None:
    """The 4-task set's short prompts (< 256 tokens) skip the prefill pool; wikisql's go through it."""
    sim = Simulation(_scenario(disaggregation="conditional:256"))
    result = sim.run()
    gateway = sim.gateway
    assert isinstance(gateway, PdGateway)
    assert len(result.outcomes) == 80
    assert all(o.status == 200 and o.tokens == o.spec.output_tokens for o in result.outcomes)
    prefills = result.served_by_engine["prefill-0"] + result.served_by_engine["prefill-1"]
    long_prompts = sum(1 for o in result.outcomes if gateway_prompt(o.spec) >= 256)
    assert prefills == long_prompts == 80 - gateway.whole
    assert 0 < gateway.whole < 80
    assert all(r.in_flight == 0 and not r.unprefilled for r in gateway.fleet.records.values())
    nodes = {n.engine_id: n.model for n in sim.nodes}
    # a whole request prefills on the decode engine, so only long prompts' KV crossed a link
    assert nodes["decode-0"].link_transfers + nodes["decode-1"].link_transfers == long_prompts


def gateway_prompt(spec: object) -> int:
    from gateway.api.request_parse import chat_prompt_estimate

    return chat_prompt_estimate(1, spec.prompt_tokens)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("mode", "whole"), [("never", 80), ("always", 0)])
def test_never_and_always(mode: str, whole: int) -> None:
    sim = Simulation(_scenario(disaggregation=mode))
    result = sim.run()
    gateway = sim.gateway
    assert isinstance(gateway, PdGateway)
    assert gateway.whole == whole and len(result.outcomes) == 80
    assert result.served_by_engine["prefill-0"] + result.served_by_engine["prefill-1"] == 80 - whole


def test_the_profile_decides_when_the_scenario_does_not() -> None:
    """No override: the routing profile's disaggregation section (default: conditional, 256)."""
    sim = Simulation(_scenario(disaggregation=None, requests=40))
    sim.run()
    assert isinstance(sim.gateway, PdGateway) and 0 < sim.gateway.whole < 40


def test_a_slowdown_targets_the_named_decode_engine() -> None:
    from gateway.simulator.disturbance import Disturbance

    slow = Disturbance.parse("slow-engine:0:100:4:decode-1")
    assert slow.engine == "decode-1" and slow.magnitude == 4
    sim = Simulation(_scenario(disturbances=(slow,), requests=40, qps=10.0, pd_mode="one-shot"))
    sim.run()
    nodes = {n.engine_id: n for n in sim.nodes}
    step = {e: nodes[e].busy_s / nodes[e].steps for e in ("decode-0", "decode-1")}
    assert step["decode-1"] > 3 * step["decode-0"], step  # 4x slower steps (over larger batches)
    with pytest.raises(ValueError, match="no engine 'decode-9'"):
        Simulation(_scenario(disturbances=(Disturbance("slow-engine", 0, 1, 2, "decode-9"),)))


def test_one_shot_pairs_round_robin() -> None:
    result = Simulation(_scenario(pd_mode="one-shot")).run()
    assert result.served_by_engine["decode-0"] == result.served_by_engine["decode-1"] == 40


def test_two_stage_steers_decodes_away_from_a_congested_link() -> None:
    """With a slow link the transfers queued into an engine count as its load: two-stage spreads
    the transfers, and never sends everything to one engine."""
    result = Simulation(_scenario(pd_mode="two-stage", link_gbps=0.3, qps=30.0, requests=120)).run()
    served = [result.served_by_engine["decode-0"], result.served_by_engine["decode-1"]]
    assert min(served) >= 0.4 * sum(served), served


def test_rmlq_transfers_beat_fifo_on_a_constrained_link() -> None:
    """Tight-TTFT transfers overtake loose ones (wikisql's 20 s) that FIFO lets go first."""
    attained = {}
    for order in ("fifo", "rmlq"):
        result = Simulation(
            _scenario(
                policy="hyperflexis",
                link_gbps=0.22,
                qps=40.0,
                duration_s=10.0,
                requests=400,
                transfer_order=order,
            )
        ).run()
        attained[order] = summarize(result.outcomes).ttft_attainment
    assert attained["rmlq"] > attained["fifo"] + 0.2, attained


def test_two_stage_beats_one_shot_rr_under_overload() -> None:
    attained = {}
    for policy, mode in (("round-robin", "one-shot"), ("hyperflexis", "two-stage")):
        result = Simulation(
            _scenario(policy=policy, pd_mode=mode, qps=110.0, duration_s=8.0, requests=880)
        ).run()
        attained[mode] = summarize(result.outcomes).attainment
    assert attained["two-stage"] >= 1.5 * attained["one-shot"], attained


def test_simulate_pd_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    argv = [
        "simulate",
        "--pd",
        "1:1",
        "--policies",
        "round-robin,hyperflexis",
        "--qps",
        "5",
        "--requests",
        "30",
    ]
    argv += ["--transfer-order", "rmlq", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    assert "P/D 1:1 (two-stage)" in capsys.readouterr().err
    points = strict_json((out / "points.json").read_text())
    assert sorted(p["policy"] for p in points) == ["hyperflexis", "round-robin"]
    assert all(p["requests"] == 30 for p in points)


def test_simulate_rejects_a_bad_pd(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--pd", "2:0"])
    assert "P:D" in capsys.readouterr().err


def test_experiment_pd_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd"
    argv = ["experiment", "pd", "--qps", "10,150", "--duration", "2", "--link-gbps", "0.3"]
    argv += ["--transfer-qps", "10", "--decode-duration", "1", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "(26/26)" in captured.err  # progress per finished run
    table = (out / "pd.md").read_text()
    assert "| 150 | one-shot RR |" in table and "RMLQ transfers" in table and "Verdict" in table
    assert "### Decode placement where the decode stage matters" in table
    assert "| decode-1 2x slower (known), 3P:2D | 24 | one-shot least-load |" in table
    points = strict_json((out / "pd.json").read_text())
    assert {p["series"] for p in points} == {
        "one-shot RR",
        "one-shot least-load",
        "two-stage",
        "RR + two-stage decode",
        "FIFO transfers",
        "RMLQ transfers",
    }
    decode = [p for p in points if p["part"] == "decode"]
    assert len(decode) == 18 and all(p["requests"] > 0 for p in decode)
    assert (out / "pd.png").stat().st_size > 10_000


def test_prefill_engines_learn_their_latency_model_from_the_prefill_stages() -> None:
    """A P/D prefill is not streamed, so no token of it passed the learner: prefill engines kept
    their prior for good, and the prior is what places the prefill pool. Timed alone on its engine
    (light load here), each prefill stage is a sample."""
    # engines at half the speed of the profile the gateway's prior comes from
    sim = Simulation(_scenario(qps=2.0, requests=40, duration_s=30.0, engine_speed=0.5))
    learner = sim.gateway.slo.latency
    result = sim.run()
    assert all(o.status == 200 for o in result.outcomes)
    for engine in ("prefill-0", "prefill-1"):
        samples, _ = learner.sample_counts(engine)
        assert samples >= 5, engine
        model = learner.models[engine]
        prompt = 500
        learnt, prior = (predict_prefill(c, [prompt]) for c in (model.prefill, model.prior_prefill))
        # what it learnt is the engine's own speed, twice the prior's time
        assert learnt == pytest.approx(2 * prior, rel=0.15), (engine, model.prefill, model.prior_prefill)


def test_simulate_refuses_two_policies_that_are_one_run() -> None:
    """With --engine-priority every policy gets deadline scheduling on its engines, so
    'least-load' and 'least-load+prio' are one run: their results were filed under one label."""
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "--policies", "least-load,least-load+prio", "--engine-priority"])
    assert "same run twice" in str(refused.value) and "+prio" in str(refused.value)
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "--policies", "hyperflexis,hyperflexis"])
    assert "same run twice" in str(refused.value)
