"""The offline cluster simulator: virtual clock, engine stepping, and the gateway's own core in it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from gateway.experiments.replay import summarize
from gateway.experiments.workload import RequestSpec
from gateway.fleet.registry import RunningEntry
from gateway.sim.engine import SimRequest
from gateway.simulator.clock import EventQueue
from gateway.simulator.engine_node import EngineNode
from gateway.simulator.gateway_node import engine_prompt
from gateway.simulator.scenario import Scenario, Simulation, run, workload_for
from tests.sim.helpers import profile


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    clock = EventQueue()
    seen: list[tuple[float, str]] = []
    clock.at(2.0, lambda: seen.append((clock.now, "b")))
    clock.at(1.0, lambda: seen.append((clock.now, "a")))
    clock.at(2.0, lambda: seen.append((clock.now, "c")))

    def later() -> None:
        seen.append((clock.now, "d"))
        clock.at(0.5, lambda: seen.append((clock.now, "never before now")))  # clamped to now

    clock.at(3.0, later)
    clock.run()
    assert seen == [(1.0, "a"), (2.0, "b"), (2.0, "c"), (3.0, "d"), (3.0, "never before now")]
    assert clock.events == 5


class _Collect:
    def __init__(self) -> None:
        self.tokens: dict[str, list[float]] = {}
        self.finished: dict[str, float] = {}

    def on_tokens(self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float) -> None:
        for request, _ in tokens:
            self.tokens.setdefault(request.request_id, []).append(now)

    def on_finished(self, engine_id: str, requests: list[SimRequest], now: float) -> None:
        for request in requests:
            self.finished[request.request_id] = now


def test_an_engine_node_steps_the_engine_model_at_its_own_step_times() -> None:
    """TTFT 0.3 s and 40 ms per token whatever the lengths: tokens land exactly there."""
    zero = dict.fromkeys(("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"), 0.0)
    clock = EventQueue()
    sink = _Collect()
    node = EngineNode("e", profile(latency={**zero, "prefill_a": 0.3, "decode_a": 0.04}), clock, sink)
    clock.at(1.0, node.add, SimRequest("r", list(range(50)), 5, 1.0, ignore_eos=True))
    clock.run()
    assert sink.tokens["r"] == pytest.approx([1.3, 1.34, 1.38, 1.42, 1.46])
    assert sink.finished["r"] == pytest.approx(1.46)
    assert node.busy_s == pytest.approx(0.46)


def _small(**kw: object) -> Scenario:
    base = Scenario("hyperflexis-4task", qps=20, policy="least-load", engines=2, requests=300, seed=4)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["least-load", "round-robin", "hyperflexis"])
def test_every_request_is_answered_once_and_the_gateway_ends_with_nothing_held(policy: str) -> None:
    scenario = _small(policy=policy, qps=8, max_engine_load=8)
    result = run(scenario)
    assert len(result.outcomes) == 300
    assert sorted(o.spec.at for o in result.outcomes) == sorted(s.at for s in workload_for(scenario))
    assert all(o.status == 200 and o.tokens == o.spec.output_tokens for o in result.outcomes)
    assert {o.engine for o in result.outcomes} == {"sim-0", "sim-1"}


def test_the_gateways_shadow_and_queue_return_to_zero_and_the_load_limit_holds() -> None:
    sim = Simulation(_small(qps=200, max_engine_load=3))
    fleet = sim.gateway.fleet
    loads: list[int] = []
    reserve = fleet.reserve

    def watched(engine_id: str, request_id: str, entry: RunningEntry) -> None:
        reserve(engine_id, request_id, entry)
        loads.append(fleet.records[engine_id].in_flight)

    fleet.reserve = watched  # type: ignore[method-assign]
    result = sim.run()
    served = sum(o.status == 200 for o in result.outcomes)
    assert len(result.outcomes) == 300 and len(loads) == served > 0
    assert max(loads) == 3  # saturated, never above the limit
    assert all(r.in_flight == 0 and not r.running and r.running_tokens == 0 for r in fleet.records.values())
    assert sim.gateway.core.queued() == 0 and not sim.gateway.core.tickets and not sim.gateway.flights


def test_same_seed_same_results_and_another_seed_differs() -> None:
    a, b = run(_small()), run(_small())
    assert [(o.ttft_s, o.e2e_s, o.engine) for o in a.outcomes] == [
        (o.ttft_s, o.e2e_s, o.engine) for o in b.outcomes
    ]
    c = run(_small(seed=5))
    assert [o.e2e_s for o in a.outcomes] != [o.e2e_s for o in c.outcomes]


def test_the_gateway_reads_engine_state_only_at_scrapes() -> None:
    """With a 1,000 s monitor interval the gateway has only the first scrape (all idle): routing
    then rests on its own shadow, exactly as live between scrapes."""
    sim = Simulation(_small(monitor_interval_s=1000.0, qps=60))
    slow = sim.run()
    assert summarize(slow.outcomes).requests == 300  # still served, from the shadow alone
    records = sim.gateway.fleet.records.values()
    makespan = max(o.start_s + o.e2e_s for o in slow.outcomes)
    assert makespan > 1.0 and all(r.state is not None and r.state_at < 1.0 for r in records)
    assert all(r.state is not None and r.state.num_running == 0 for r in records)  # (idle, as first seen)


def test_a_request_that_can_never_start_ends_the_run_with_an_error_not_a_spin() -> None:
    """A KV cache smaller than one prompt: the engine never starts it, and the periodic scrapes
    kept the event heap from emptying, so the run spun in virtual time for good."""
    scenario = _small(num_gpu_blocks=2, requests=20)
    with pytest.raises(RuntimeError, match="ran out of events"):
        run(scenario)


def test_overload_queues_in_the_gateway_and_sheds_by_the_profile() -> None:
    # 2 engines x 2 seats at 400 QPS: the class queues fill and the profile's limits answer 429
    result = run(_small(qps=400, requests=600, max_engine_load=2))
    statuses = {o.status for o in result.outcomes}
    assert 200 in statuses and statuses <= {200, 429}
    assert 429 in statuses
    refused = [o for o in result.outcomes if o.status == 429]
    assert all(math.isinf(o.ttft_s) and not o.met for o in refused)


def test_engine_prompts_are_the_chat_template_around_the_workload_tokens() -> None:
    from gateway.experiments.prompts import spec_prompt_text
    from gateway.tokenizer import apply_chat_template, encode

    for spec in workload_for(Scenario("multi-turn", qps=5, policy="least-load", requests=30, seed=2)):
        text = apply_chat_template([{"role": "user", "content": spec_prompt_text(spec)}])
        assert engine_prompt(spec) == encode(text)


def test_engine_priority_reaches_the_engines_when_scheduling_by_priority() -> None:
    # every spec the same except its SLO: with priority scheduling, tight requests overtake lax ones
    specs = [
        RequestSpec(
            at=0.001 * i,
            task="t",
            priority=0,
            prompt_tokens=400,
            output_tokens=20,
            ttft_s=0.5 if i % 2 else 30.0,
            tpot_s=1.0,
        )
        for i in range(200)
    ]
    fifo = run(_small(engines=1, slo_profile="hyperflexis-4task"), specs)
    prio = run(_small(engines=1, engine_priority=True), specs)

    def tight_ttft(result: object) -> float:
        outcomes = result.outcomes  # type: ignore[attr-defined]
        return sum(o.ttft_s for o in outcomes if o.spec.ttft_s < 1) / 100

    assert tight_ttft(prio) < 0.75 * tight_ttft(fifo)  # (equal if the priority never reached them)


def test_with_task_bounds_the_dispatcher_knows_a_bound_per_task_not_each_length() -> None:
    """With each request's max_tokens its exact length, the length-aware orders (wspt, the
    demotion of the longest, HyperFlexis's KV need) had an oracle no client gives: with
    task-p99 they see what a client sends, its task's 99th percentile, and the longest answers
    are cut there."""
    from gateway.experiments.workload import with_task_bounds

    exact = _small(requests=200)
    specs = workload_for(exact)
    bounded = workload_for(dataclasses.replace(exact, output_bound="task-p99"))
    assert [s.output_tokens for s in bounded] == [s.output_tokens for s in specs]
    assert all(s.max_tokens is None and s.bound == s.output_tokens for s in specs)
    for task in {s.task for s in specs}:
        lengths = sorted(s.output_tokens for s in specs if s.task == task)
        caps = {s.max_tokens for s in bounded if s.task == task}
        assert caps == {lengths[min(len(lengths) - 1, math.ceil(0.99 * len(lengths)) - 1)]}
    assert with_task_bounds([]) == []
    sim = Simulation(dataclasses.replace(exact, output_bound="task-p99"))
    seen: list[int] = []
    choose = sim.gateway.core.router.choose

    def watched(request: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(request.max_output_tokens)
        return choose(request, *args, **kwargs)

    sim.gateway.core.router.choose = watched  # type: ignore[method-assign]
    result = sim.run()
    caps = {s.max_tokens for s in bounded}
    assert seen and set(seen) <= caps  # the dispatcher saw bounds, never an exact length
    assert all(
        o.tokens == min(o.spec.output_tokens, o.spec.bound) for o in result.outcomes if o.status == 200
    )
    with pytest.raises(ValueError, match="output_bound"):
        workload_for(dataclasses.replace(exact, output_bound="oracle"))


def test_a_prefill_engine_whose_held_kv_frees_plans_again() -> None:
    """A prefill engine keeps each prompt's KV until its transfer ends; with its cache full of
    held KV it plans nothing and goes idle. Freed by the transfer's end, nothing woke it: the
    waiting prefills started only at the next request sent there, or never."""
    clock = EventQueue()
    sink = _Collect()
    node = EngineNode("e", profile(num_gpu_blocks=8, block_size=16), clock, sink)
    clock.at(0.0, node.add, SimRequest("a", list(range(100)), 1, 0.0, prefill_only=True))
    clock.at(0.5, node.add, SimRequest("b", list(range(200, 300)), 1, 0.5, prefill_only=True))
    clock.at(2.0, node.release_held, "a")
    clock.run()
    assert "a" in sink.tokens and "b" in sink.tokens, (sink.tokens, node.model.has_work)
    assert min(sink.tokens["b"]) > 2.0  # (it could not start before a's KV was freed)
    assert node.steps == 2 and node.busy_s > 0
