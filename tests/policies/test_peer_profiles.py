"""The peer-style routing plugins and profiles on literal snapshots: SGLang's cache-aware picker
(cache threshold, balance thresholds, most room), Dynamo's cost, llm-d's weighted scorers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from policies.api import EngineSnapshot, EngineState, PrefixMatch, RequestView
from policies.pipeline import compile_profile
from policies.plugins.peers import DynamoCost, SglangCacheAware

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "routing"


def _engine(
    name: str, load: int = 0, kv: float = 0.2, running_tokens: int = 0, waiting: int = 0
) -> EngineSnapshot:
    state = EngineState(num_running=load, num_waiting=waiting, kv_usage=kv)
    return EngineSnapshot(name, "m", state=state, running_tokens=running_tokens, in_flight=0)


def _request(cached: dict[str, int], prompt: int = 1000) -> RequestView:
    return RequestView("r", "m", prompt, 10, prefix=PrefixMatch(prompt, cached))


def _pick(picker: SglangCacheAware, request: RequestView, engines: list[EngineSnapshot]) -> str:
    chosen, _ = picker.pick(request, engines, [0.0] * len(engines), picker.initial_state())
    return chosen.engine_id


def test_sglang_goes_to_the_best_match_above_the_threshold() -> None:
    picker = SglangCacheAware()
    engines = [_engine("a", 10), _engine("b", 5), _engine("c", 2)]
    assert _pick(picker, _request({"a": 500, "b": 200}), engines) == "a"


def test_sglang_below_the_threshold_takes_the_emptiest_cache() -> None:
    picker = SglangCacheAware()
    engines = [_engine("a", 1, kv=0.6), _engine("b", 9, kv=0.1), _engine("c", 0, kv=0.4)]
    # 0.25 of the prompt is not over 0.3: the match does not count, the most room does
    assert _pick(picker, _request({"a": 250}), engines) == "b"


def test_sglang_imbalance_needs_both_thresholds() -> None:
    picker = SglangCacheAware()
    hot = _request({"a": 900})
    # 70 requests apart and 1.5x: the least loaded, whatever is cached
    assert _pick(picker, hot, [_engine("a", 100), _engine("b", 30)]) == "b"
    # 65 apart but within 1.5x: still the cache
    assert _pick(picker, hot, [_engine("a", 200), _engine("b", 135)]) == "a"
    # 1.5x apart but within 64: still the cache
    assert _pick(picker, hot, [_engine("a", 60), _engine("b", 10)]) == "a"


def test_dynamo_cost_is_prefill_left_plus_decode_load() -> None:
    scorer = DynamoCost()
    engines = [_engine("a", running_tokens=5000), _engine("b", running_tokens=300), _engine("c")]
    request = _request({"a": 1000, "b": 200})
    assert scorer.costs(request, engines) == [5000.0, 1100.0, 1000.0]
    scores = scorer.score(request, engines, 0.0)
    assert scores.index(max(scores)) == 2
    # the cached prompt outweighs a smaller decode load
    assert DynamoCost().costs(_request({"a": 1000}), [_engine("a", running_tokens=500), _engine("b")]) == [
        500.0,
        1000.0,
    ]


@pytest.mark.parametrize("name", ["sglang", "llm-d", "dynamo"])
def test_the_peer_profiles_compile_and_follow_the_cache(name: str) -> None:
    pipeline = compile_profile(yaml.safe_load((PROFILES / f"{name}.yaml").read_text()))
    engines = [_engine("a", 2, kv=0.3, waiting=1), _engine("b", 2, kv=0.3, waiting=1)]
    chosen, _ = pipeline.choose(_request({"b": 1000}), engines, pipeline.picker.initial_state(), 0.0)
    assert chosen is not None and chosen.engine_id == "b"


def test_llm_d_weights() -> None:
    data = yaml.safe_load((PROFILES / "llm-d.yaml").read_text())
    assert {s["name"]: s["weight"] for s in data["scorers"]} == {
        "prefix_match": 3.0,
        "queue_depth": 2.0,
        "kv_free": 2.0,
    }
