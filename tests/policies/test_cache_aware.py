"""Cache-, load- and affinity-aware routing plugins on literal snapshots: prefix match, KV
utilisation, queue depth, token load, session affinity and its store, the imbalance guard,
random tie-breaking, and Gimbal's Algorithm 1 with its thresholds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from policies.api import Affinity, EngineSnapshot, EngineState, PolicyConfigError, PrefixMatch, RequestView
from policies.pipeline import compile_profile
from policies.plugins.affinity import MemoryAffinityStore, SessionAffinity, affinity_key
from policies.plugins.cache_aware import (
    ImbalanceGuard,
    KvUtilisation,
    PrefixMatchScorer,
    QueueDepth,
    TokenLoad,
    queued,
)
from policies.plugins.gimbal import Gimbal, GimbalParams, GimbalState, select
from policies.plugins.pickers import MaxScoreRandom, random_choice, split_mix
from policies.registry import build


def eng(
    eid: str,
    in_flight: int = 0,
    kv: float | None = 0.0,
    waiting: int = 0,
    running: int = 0,
    tokens: int = 0,
    at_scrape: int = 0,
    stale: bool = False,
    weight: float = 1.0,
) -> EngineSnapshot:
    state = None if kv is None else EngineState(num_running=running, num_waiting=waiting, kv_usage=kv)
    return EngineSnapshot(
        eid,
        "m",
        in_flight=in_flight,
        in_flight_at_scrape=at_scrape,
        state=state,
        stale=stale,
        weight=weight,
        running_tokens=tokens,
    )


def req(
    prefix: dict[str, int] | None = None,
    prompt: int = 1000,
    session: str | None = None,
    target: str | None = None,
) -> RequestView:
    return RequestView(
        "r",
        "m",
        prompt,
        100,
        prefix=None if prefix is None else PrefixMatch(prompt, prefix),
        affinity=None if session is None else Affinity(session, target),
    )


# -- prefix match --------------------------------------------------------------------------------


def test_prefix_match_is_the_cached_fraction() -> None:
    engines = [eng("a"), eng("b"), eng("c")]
    scorer = PrefixMatchScorer()
    assert scorer.score(req({"a": 800, "b": 160}), engines, 0.0) == [0.8, 0.16, 0.0]
    assert scorer.score(req({"a": 5000}), engines, 0.0) == [1.0, 0.0, 0.0]  # clamped
    assert scorer.score(req(None), engines, 0.0) == [0.0, 0.0, 0.0]  # no index: engines alike


def test_prefix_match_yields_to_load_over_the_bound() -> None:
    scorer = PrefixMatchScorer(max_spread=8, max_ratio=1.5)
    r = req({"a": 1000, "b": 1000})
    # a is 9 requests above the least loaded (and 10x it): it loses its credit; b (4 above) keeps it
    assert scorer.score(r, [eng("a", 10), eng("b", 5), eng("c", 1)], 0.0) == [0.0, 1.0, 0.0]
    # 8 above is within the bound
    assert scorer.score(r, [eng("a", 9), eng("b", 5), eng("c", 1)], 0.0) == [1.0, 1.0, 0.0]
    # both thresholds must be crossed: 20 above but only 1.2x
    assert scorer.score(r, [eng("a", 120), eng("b", 110), eng("c", 100)], 0.0) == [1.0, 1.0, 0.0]
    assert PrefixMatchScorer(max_spread=None).score(r, [eng("a", 100), eng("c", 0)], 0.0) == [1.0, 0.0]


def test_guard_counts_load_per_unit_of_weight() -> None:
    guard = ImbalanceGuard(max_spread=8, max_ratio=1.5)
    assert guard.over([eng("big", 20, weight=2.0), eng("small", 5)]) == [False, False]
    assert guard.over([eng("big", 28, weight=2.0), eng("small", 5)]) == [True, False]
    with pytest.raises(ValueError):
        ImbalanceGuard(max_spread=-1)
    with pytest.raises(ValueError):
        ImbalanceGuard(max_ratio=0.5)


# -- KV utilisation, queue depth, token load ------------------------------------------------------


def test_kv_utilisation_is_relative() -> None:
    scorer = KvUtilisation()
    assert scorer.score(
        req(), [eng("a", kv=0.40), eng("b", kv=0.45), eng("c", kv=0.50)], 0.0
    ) == pytest.approx([1.0, 0.5, 0.0])
    # unknown or stale readings score 0.5 and do not set the range
    assert scorer.score(req(), [eng("a", kv=0.2), eng("b", kv=None), eng("c", kv=0.9, stale=True)], 0.0) == [
        1.0,
        0.5,
        0.5,
    ]
    assert scorer.score(req(), [eng("a", kv=None)], 0.0) == [0.5]


def test_queue_depth_counts_waiting_and_what_was_sent_since_the_scrape() -> None:
    # a: 3 waiting at the scrape, 2 sent since; b: 1 waiting; c: no fresh scrape, 4 in flight
    a = eng("a", in_flight=7, waiting=3, running=5, at_scrape=5)
    b = eng("b", in_flight=6, waiting=1, running=5, at_scrape=6)
    c = eng("c", in_flight=4, kv=None)
    assert [queued(e) for e in (a, b, c)] == [5.0, 1.0, 4.0]
    assert QueueDepth().score(req(), [a, b, c], 0.0) == pytest.approx([0.0, 1.0, 0.25])


def test_token_load_prefers_fewer_running_tokens() -> None:
    engines = [eng("a", tokens=30_000), eng("b", tokens=10_000), eng("c", tokens=20_000, weight=2.0)]
    assert TokenLoad().score(req(), engines, 0.0) == [0.0, 1.0, 1.0]
    assert TokenLoad().score(req(), [eng("a"), eng("b")], 0.0) == [1.0, 1.0]


# -- session affinity -----------------------------------------------------------------------------


def test_affinity_keys() -> None:
    assert affinity_key("t", session_id="s1", user="u") == "t\x1fs:s1"
    assert affinity_key("t", user="u") == "t\x1fu:u"
    assert affinity_key("t") is None
    assert affinity_key("t1", user="alice") != affinity_key("t2", user="alice")
    assert affinity_key("t", session_id="x") != affinity_key("t", user="x")
    long = affinity_key("t", session_id="s" * 10_000)
    assert long is not None and len(long) < 64


def test_memory_store_ttl_and_bound() -> None:
    store = MemoryAffinityStore(ttl_s=10.0, max_entries=4)
    store.put("a", "e1", now=0.0)
    store.put("b", "e2", now=1.0)
    assert store.get("a", now=10.0) == "e1"
    assert store.get("a", now=10.1) is None  # expired: routed like a new session
    store.put("a", "e3", now=11.0)
    store.put("c", "e1", now=12.0)  # over probation's half: b, least recently used, is forgotten
    assert store.get("b", now=12.0) is None and store.get("a", now=12.0) == "e3" and len(store) == 2


def test_sessions_that_came_back_outlive_a_flood_of_new_ones() -> None:
    """One client sending each request with a new session id pushed every other session out of a
    single LRU: their next turns went by load to cold engines. A session seen twice is protected;
    the flood churns the probation half only."""
    store = MemoryAffinityStore(ttl_s=600.0, max_entries=100)
    for i in range(30):  # conversations: two turns each
        store.put(f"chat-{i}", f"e{i % 4}", now=0.0)
        store.put(f"chat-{i}", f"e{i % 4}", now=1.0)
    for i in range(10_000):
        store.put(f"spray-{i}", "e0", now=2.0)
    assert all(store.get(f"chat-{i}", now=3.0) == f"e{i % 4}" for i in range(30))
    assert len(store) <= 100 and store.get("spray-0", now=3.0) is None
    assert store.get("spray-9999", now=3.0) == "e0"  # (a new one's first turn is still kept)
    # past the protected half, the least recent protected session goes back on probation
    for i in range(60):
        store.put(f"more-{i}", "e1", now=4.0)
        store.put(f"more-{i}", "e1", now=4.0)
    assert len(store) <= 100 and store.get("more-59", now=5.0) == "e1"
    for i in range(10_000):  # (another flood: what went back on probation goes)
        store.put(f"spray-again-{i}", "e0", now=6.0)
    assert not any(store.get(f"chat-{i}", now=7.0) for i in range(30))
    assert all(store.get(f"more-{i}", now=7.0) == "e1" for i in range(10, 60))  # (the protected half)


def test_session_affinity_keeps_the_engine_until_it_is_over_the_bound() -> None:
    scorer = SessionAffinity(max_spread=8, max_ratio=1.5)
    r = req(session="k", target="b")
    assert scorer.score(r, [eng("a", 2), eng("b", 10), eng("c", 3)], 0.0) == [0.0, 1.0, 0.0]
    assert scorer.score(r, [eng("a", 2), eng("b", 11), eng("c", 3)], 0.0) == [0.0, 0.0, 0.0]
    assert scorer.score(req(session="k", target="gone"), [eng("a"), eng("b")], 0.0) == [0.0, 0.0]
    assert scorer.score(req(session="k"), [eng("a"), eng("b")], 0.0) == [0.0, 0.0]
    assert scorer.score(req(), [eng("a"), eng("b")], 0.0) == [0.0, 0.0]


# -- random tie-breaking --------------------------------------------------------------------------


def test_split_mix_reference_values() -> None:
    # SplitMix64 from seed 0 (Vigna's reference): 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4
    value, state = split_mix(0)
    assert value == 0xE220A8397B1DCDAF
    assert split_mix(state)[0] == 0x6E789E6AA1B965F4


def test_random_ties_are_uniform_and_ignore_list_order() -> None:
    picker = MaxScoreRandom(seed=7)
    engines = [eng("a"), eng("b"), eng("c"), eng("d")]
    state = picker.initial_state()
    counts: Counter[str] = Counter()
    for _ in range(4000):
        chosen, state = picker.pick(req(), engines, [1.0, 1.0, 1.0, 0.5], state)
        counts[chosen.engine_id] += 1
    assert counts["d"] == 0 and all(1200 < counts[e] < 1470 for e in "abc")
    # the same state replays the same decision; no draw when one engine leads
    s = picker.initial_state()
    assert picker.pick(req(), engines, [1, 1, 0, 0], s) == picker.pick(req(), engines, [1, 1, 0, 0], s)
    assert picker.pick(req(), engines, [0, 1, 0, 0], s) == (engines[1], s)
    assert random_choice(1, 5) == (0, 5)


# -- Gimbal, Algorithm 1 --------------------------------------------------------------------------

P = GimbalParams()


def gimbal(
    engines: list[EngineSnapshot], r: RequestView | None = None, state: GimbalState | None = None
) -> tuple[str, str]:
    chosen, reason, _ = select(r or req(), engines, P, state or GimbalState())
    return chosen.engine_id, reason


def test_gimbal_round_robin_without_metrics() -> None:
    engines = [eng("b", kv=0.95), eng("a", kv=None), eng("c", kv=0.1)]
    state = GimbalState()
    seen = []
    for _ in range(4):
        chosen, reason, state = select(req(session="k", target="c"), engines, P, state)
        seen.append((chosen.engine_id, reason))
    # no affinity either: the paper applies it only with metric data (line 15 is under line 2)
    assert seen == [("a", "round_robin"), ("b", "round_robin"), ("c", "round_robin"), ("a", "round_robin")]


def test_gimbal_kv_threshold_and_difference() -> None:
    # the fullest is at theta_kv and 0.1 above the emptiest: the emptiest wins
    assert gimbal([eng("a", kv=0.9), eng("b", kv=0.8), eng("c", kv=0.85)]) == ("b", "kv_least")
    # just under theta_kv: not saturated, round robin (no session)
    assert gimbal([eng("a", kv=0.899), eng("b", kv=0.1)]) == ("a", "round_robin")
    # saturated but within theta_diff: running load decides if it differs by more than theta_load
    engines = [eng("a", kv=0.95, tokens=9000), eng("b", kv=0.9, tokens=5999), eng("c", kv=0.92, tokens=7000)]
    assert gimbal(engines) == ("b", "load_least")
    engines = [eng("a", kv=0.95, tokens=9000), eng("b", kv=0.9, tokens=6000), eng("c", kv=0.92, tokens=7000)]
    assert gimbal(engines) == ("a", "round_robin")  # 3000 is not more than theta_load


def test_gimbal_affinity_only_when_no_engine_is_over_theta_kv() -> None:
    engines = [eng("a", kv=0.5), eng("b", kv=0.6), eng("c", kv=0.2)]
    assert gimbal(engines, req(session="k", target="b")) == ("b", "affinity")
    assert gimbal(engines, req(session="k", target="gone")) == ("a", "round_robin")
    saturated = [eng("a", kv=0.5), eng("b", kv=0.9), eng("c", kv=0.85)]
    assert gimbal(saturated, req(session="k", target="b")) == ("a", "kv_least")


def test_gimbal_ties_are_random_not_first() -> None:
    engines = [eng("a", kv=0.95), eng("b", kv=0.5), eng("c", kv=0.5), eng("d", kv=0.5)]
    counts: Counter[str] = Counter()
    state = GimbalState(0, 3)
    for _ in range(3000):
        chosen, reason, state = select(req(), engines, P, state)
        assert reason == "kv_least"
        counts[chosen.engine_id] += 1
    assert counts["a"] == 0 and all(900 < counts[e] < 1100 for e in "bcd")


def test_gimbal_optional_imbalance_guard() -> None:
    picker = Gimbal(max_spread=8)
    engines = [eng("a", 20, kv=0.5), eng("b", 2, kv=0.5)]
    chosen, state = picker.pick(req(session="k", target="a"), engines, [0, 0], picker.initial_state())
    assert chosen.engine_id == "a"  # turn 0 of the round robin: a anyway
    chosen, _ = picker.pick(req(session="k", target="a"), engines, [0, 0], state)
    assert chosen.engine_id == "b"  # a is over the bound: no affinity, round robin's turn is b
    assert Gimbal().pick(req(session="k", target="a"), engines, [0, 0], state)[0].engine_id == "a"


def test_gimbal_profile_parameters() -> None:
    picker = build("picker", "gimbal", {"theta_kv": 0.8, "theta_diff": 0.2, "theta_load": 500, "seed": 4})
    assert isinstance(picker, Gimbal) and picker.params.theta_load == 500.0
    with pytest.raises(PolicyConfigError, match="theta_kv"):
        build("picker", "gimbal", {"theta_kv": 1.5})


# -- the trap: a prompt most requests share ------------------------------------------------------


def _run_shared_prefix(profile: Mapping[str, Any], steps: int = 1000) -> tuple[float, float]:
    """4 engines each serving one request a step, three arrivals a step (75 % busy), 80 % of them
    sharing one long system prompt; an engine holds the shared prompt once it served one.
    Returns the busiest engine's share of all requests over the fair share, and the share of
    shared-prompt requests that found it cached where they went."""
    pipeline = compile_profile(profile)
    loads = dict.fromkeys("abcd", 0)
    sent: Counter[str] = Counter()
    holds: set[str] = set()
    state = pipeline.picker.initial_state()
    hits = shared = 0
    rng = 12345
    for _ in range(steps):
        for _ in range(3):
            rng = (rng * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
            is_shared = (rng >> 33) % 10 < 8
            cached = dict.fromkeys(holds, 900) if is_shared else {}
            engines = [eng(e, loads[e]) for e in "abcd"]
            chosen, state = pipeline.choose(req(cached), engines, state, 0.0)
            assert chosen is not None
            loads[chosen.engine_id] += 1
            sent[chosen.engine_id] += 1
            if is_shared:
                shared += 1
                hits += chosen.engine_id in holds
                holds.add(chosen.engine_id)
        for e in loads:
            loads[e] = max(0, loads[e] - 1)
    return max(sent.values()) / (sum(sent.values()) / 4), hits / shared


PREFIX_AND_LOAD = {
    "scorers": [{"name": "prefix_match", "weight": 2.0}, {"name": "least_load", "weight": 1.0}],
    "picker": {"name": "max_score_random"},
}


def test_a_shared_system_prompt_does_not_pile_onto_one_engine() -> None:
    spread, hit_rate = _run_shared_prefix(PREFIX_AND_LOAD)
    assert spread <= 1.3 and hit_rate > 0.95
    # without the guard the shared prompt drags everything to the engines that hold it first
    unguarded = {
        **PREFIX_AND_LOAD,
        "scorers": [
            {"name": "prefix_match", "weight": 2.0, "params": {"max_spread": None}},
            {"name": "least_load", "weight": 1.0},
        ],
    }
    assert _run_shared_prefix(unguarded)[0] > 2.0
