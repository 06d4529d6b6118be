"""LoRA affinity on literal snapshots: the filter keeps the engines that have the request's adapter
loaded (all of them when none has, or when engines load on demand), the scorer prefers them under
the imbalance guard, and in a profile ties among them are broken at random."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from policies.api import EngineSnapshot, PolicyConfigError, RequestView
from policies.pipeline import compile_profile
from policies.plugins.lora import LoraAffinity, with_adapter
from policies.registry import build


def eng(eid: str, adapters: Sequence[str] = (), in_flight: int = 0) -> EngineSnapshot:
    return EngineSnapshot(eid, "m", in_flight=in_flight, adapters=frozenset(adapters))


def req(lora: str | None) -> RequestView:
    return RequestView("r", "m", 100, 10, lora=lora)


FLEET = (eng("e0", ["a1"]), eng("e1"), eng("e2", ["a1", "a2"]), eng("e3", ["a2"]))


def ids(engines: Sequence[EngineSnapshot]) -> list[str]:
    return [e.engine_id for e in engines]


def test_the_filter_keeps_the_engines_with_the_adapter() -> None:
    plugin = LoraAffinity()
    assert ids(plugin.filter(req("a1"), FLEET, 0.0)) == ["e0", "e2"]
    assert ids(plugin.filter(req("a2"), FLEET, 0.0)) == ["e2", "e3"]
    # a base-model request: every engine serves it
    assert ids(plugin.filter(req(None), FLEET, 0.0)) == ["e0", "e1", "e2", "e3"]
    # no candidate has it (read before the load, or an engine that loads on demand): keep them all
    assert ids(plugin.filter(req("a9"), FLEET, 0.0)) == ["e0", "e1", "e2", "e3"]
    assert ids(with_adapter(FLEET[1:2], "a1")) == ["e1"]
    assert plugin.required


def test_load_on_demand_keeps_every_engine_and_the_scorer_prefers_holders() -> None:
    plugin = LoraAffinity(load_on_demand=True)
    assert not plugin.required
    assert ids(plugin.filter(req("a1"), FLEET, 0.0)) == ["e0", "e1", "e2", "e3"]
    assert plugin.score(req("a1"), FLEET, 0.0) == [1.0, 0.0, 1.0, 0.0]
    assert plugin.score(req(None), FLEET, 0.0) == [0.0] * 4
    assert plugin.score(req("a9"), FLEET, 0.0) == [0.0] * 4


def test_the_imbalance_guard_takes_credit_from_an_overloaded_holder() -> None:
    engines = (eng("e0", ["a1"], in_flight=20), eng("e1", in_flight=2), eng("e2", ["a1"], in_flight=3))
    assert LoraAffinity().score(req("a1"), engines, 0.0) == [0.0, 0.0, 1.0]
    assert LoraAffinity(max_spread=None).score(req("a1"), engines, 0.0) == [1.0, 0.0, 1.0]


def test_registered_as_filter_and_scorer_with_checked_parameters() -> None:
    assert isinstance(build("filter", "lora_affinity"), LoraAffinity)
    assert isinstance(build("scorer", "lora_affinity", {"load_on_demand": True}), LoraAffinity)
    with pytest.raises(PolicyConfigError, match="load_on_demand"):
        build("filter", "lora_affinity", {"load_on_demand": "yes"})
    with pytest.raises(PolicyConfigError, match="max_ratio"):
        build("scorer", "lora_affinity", {"max_ratio": 0.5})


def test_a_profile_sends_adapter_requests_to_holders_with_random_ties() -> None:
    pipeline = compile_profile(
        {
            "filters": [{"name": "lora_affinity"}],
            "scorers": [{"name": "least_load"}],
            "picker": {"name": "max_score_random", "params": {"seed": 3}},
        }
    )
    state = pipeline.picker.initial_state()
    chosen: Counter[str] = Counter()
    for _ in range(200):
        engine, state = pipeline.choose(req("a1"), FLEET, state, 0.0)
        assert engine is not None
        chosen[engine.engine_id] += 1
    assert set(chosen) == {"e0", "e2"} and min(chosen.values()) > 60  # both holders, at random
    base: Counter[str] = Counter()
    for _ in range(200):
        engine, state = pipeline.choose(req(None), FLEET, state, 0.0)
        assert engine is not None
        base[engine.engine_id] += 1
    assert set(base) == {"e0", "e1", "e2", "e3"}


def test_a_soft_profile_prefers_holders_but_balances_load() -> None:
    pipeline = compile_profile(
        {
            "filters": [{"name": "lora_affinity", "params": {"load_on_demand": True}}],
            "scorers": [{"name": "lora_affinity", "weight": 2.0}, {"name": "least_load"}],
            "picker": {"name": "max_score_random"},
        }
    )
    state = pipeline.picker.initial_state()
    engines = (eng("e0", ["a1"], in_flight=3), eng("e1", in_flight=0))
    engine, state = pipeline.choose(req("a1"), engines, state, 0.0)
    assert engine is not None and engine.engine_id == "e0"  # the load costs more than 3 requests
    engines = (eng("e0", ["a1"], in_flight=30), eng("e1", in_flight=0))
    engine, state = pipeline.choose(req("a1"), engines, state, 0.0)
    assert engine is not None and engine.engine_id == "e1"  # over the guard: loaded on demand


def test_hyperflexis_gives_an_adapter_request_only_to_a_worker_with_the_adapter() -> None:
    import dataclasses

    from policies.hyperflexis import dispatch
    from tests.policies.test_hyperflexis import req, worker

    adapter = req("a")
    adapter = dataclasses.replace(adapter, view=dataclasses.replace(adapter.view, lora="a1"))
    queue = [adapter, req("b")]
    # w0 looks first and lacks a1, which w1 has: w0 takes only b
    workers = [worker("w0", maturity=-1.0), dataclasses.replace(worker("w1"), adapters=frozenset({"a1"}))]
    decision = dispatch(queue, workers, 0.0, adapters_held=frozenset({"a1"}))
    placed = {a.request_id: a.engine_id for a in decision.assignments}
    assert placed == {"a": "w1", "b": "w0"}
    # w0 alone: it leaves a queued (not "full": the next arrival may fit it) and idles on nothing
    alone = dispatch([adapter], [worker("w0")], 0.0, adapters_held=frozenset({"a1"}))
    assert alone.assignments == () and "w0" not in alone.full
    # no engine in rotation has a1: nowhere better, anyone takes it
    anyone = dispatch([adapter], [worker("w0")], 0.0)
    assert [a.engine_id for a in anyone.assignments] == ["w0"]


def test_an_idle_worker_backfills_past_an_adapter_request_held_elsewhere() -> None:
    import dataclasses

    from policies.hyperflexis import dispatch
    from tests.policies.test_hyperflexis import req, worker

    adapter = req("a", arrival=-10.0)  # late everywhere: only backfill places anything here
    adapter = dataclasses.replace(adapter, view=dataclasses.replace(adapter.view, lora="a1"))
    big = req("b", arrival=-10.0, out=100_000)  # max_tokens beyond the KV: only an idle worker takes it
    decision = dispatch([adapter, big], [worker("w0", kv=50_000)], 0.0, adapters_held=frozenset({"a1"}))
    assert [(a.request_id, a.engine_id) for a in decision.assignments] == [("b", "w0")]
