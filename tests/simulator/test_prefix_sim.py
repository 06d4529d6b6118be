"""The offline simulator feeds the same prefix index and affinity store as the live gateway: its
dispatches and its engines' KV events; prefix-aware routing then finds more of the prompts cached
(as the engines report their hits) than round robin on multi-turn sessions."""

from __future__ import annotations

from gateway.simulator.scenario import Scenario, Simulation


def _hit_rate(sim: Simulation) -> float:
    queries = sum(node.model.counters.prefix_queries for node in sim.nodes)
    hits = sum(node.model.counters.prefix_hits for node in sim.nodes)
    return hits / queries if queries else 0.0


def _run(policy: str) -> Simulation:
    sim = Simulation(Scenario("multi-turn", qps=10, policy=policy, engines=4, requests=300, seed=1))
    sim.run()
    return sim


def test_the_index_is_fed_by_dispatches_and_kv_events_and_routing_finds_the_history() -> None:
    aware = _run("prefix-aware")
    prefix = aware.gateway.prefix
    assert prefix is not None and prefix.index is not None and prefix.affinity is not None
    assert prefix.index.stats.stored > 0  # the engines' own events reached it
    assert not prefix._attached  # every request detached at its end
    baseline = _run("round-robin")
    assert baseline.gateway.prefix is None
    # measured 0.78 vs 0.58 (seed 1); the engines' cache here holds much of the working set
    assert _hit_rate(aware) > 1.2 * _hit_rate(baseline)
