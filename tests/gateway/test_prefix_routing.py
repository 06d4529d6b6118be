"""The router with the prefix index and the affinity store: candidates carry each engine's cached
prefix, choices feed the index and the store back, sessions stick within the imbalance bound."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gateway.dispatch.core import ClassLimits, DispatchCore, Ticket
from gateway.dispatch.offline import offline_fleet
from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.router import Router, load_pipeline
from gateway.tokenizer import apply_chat_template, encode
from policies.api import EngineState, RequestView
from policies.hyperflexis import HyperFlexisParams
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL
from policies.pipeline import compile_profile
from policies.plugins.affinity import MemoryAffinityStore, affinity_key
from policies.queue_order import QueuedRequest, make_order

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "routing"
MODEL = "m"
ENGINES = [f"{MODEL}-{i}" for i in range(4)]


def _setup(profile: str = "prefix-aware") -> tuple[Fleet, Router, PrefixRouting]:
    fleet = offline_fleet({MODEL: 4})
    routing = PrefixRouting(fleet, PrefixIndex(1 << 24, 120.0), MemoryAffinityStore(ttl_s=300.0))
    return fleet, Router(fleet, load_pipeline(PROFILES / f"{profile}.yaml"), routing), routing


def _chat(system: str, user: str) -> PromptBlocks:
    """The prompt as the engine renders it: the chat template's order, all messages."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return PromptBlocks(encode(apply_chat_template(messages)), root_key(MODEL))


def _view(rid: str) -> RequestView:
    return RequestView(rid, MODEL, 500, 50)


def _load(fleet: Fleet, engine: str, n: int) -> None:
    start = fleet.records[engine].in_flight
    for i in range(start, start + n):
        fleet.reserve(engine, f"{engine}-busy-{i}", RunningEntry(100, 10, 0.1, 0.0))


SYSTEM = "you are a careful assistant who answers in full sentences " * 20


def test_candidates_carry_each_engine_s_cached_prefix() -> None:
    fleet, router, routing = _setup()
    first = _chat(SYSTEM, "what is the capital of france")
    routing.attach("r1", first, None)
    chosen = router.choose(_view("r1"), now=0.0)
    assert chosen is not None
    # a second turn behind the same system prompt: the engine that took the first holds it
    second = _chat(SYSTEM, "and of spain")
    routing.attach("r2", second, None)
    view = routing.annotate(_view("r2"), fleet.candidates(MODEL), now=1.0)
    assert view.prefix is not None and view.prefix.prompt_tokens == len(second)
    cached = dict(view.prefix.cached_tokens)
    shared_blocks = next(
        i for i, (a, b) in enumerate(zip(first.hashes(16), second.hashes(16), strict=False)) if a != b
    )
    assert cached == {e: (shared_blocks * 16 if e == chosen.engine_id else 0) for e in ENGINES}
    assert router.choose(_view("r2"), now=1.0) is chosen  # and the router sends it there
    routing.detach("r1")
    routing.detach("r2")
    assert routing.attached("r1") is None
    # a request nobody attached routes by load alone, with nothing recorded
    assert routing.annotate(_view("r3"), fleet.candidates(MODEL), 2.0) == _view("r3")


def test_a_session_sticks_while_its_engine_is_within_the_bound() -> None:
    fleet, router, routing = _setup()
    key = affinity_key("tenant", session_id="conversation-7")
    assert key is not None
    routing.attach("t1", None, key)
    home = router.choose(_view("t1"), now=0.0)
    assert home is not None
    for turn in range(2, 8):  # each turn is more load on home: it stays while within 8 of the least
        _load(fleet, home.engine_id, 1)
        routing.attach(f"t{turn}", None, key)
        assert router.choose(_view(f"t{turn}"), now=float(turn)) is home
    _load(fleet, home.engine_id, 3)  # 9 above the others: over the bound, load wins
    routing.attach("t9", None, key)
    moved = router.choose(_view("t9"), now=9.0)
    assert moved is not None and moved is not home
    # and the session now lives where it went (the store records every choice)
    assert routing.affinity is not None and routing.affinity.get(key, 9.0) == moved.engine_id


def test_cache_misses_spread_over_the_engines() -> None:
    """Distinct prompts (every one a miss) on idle engines: random ties, not the first engine."""
    _, router, routing = _setup()
    counts: Counter[str] = Counter()
    for i in range(400):
        routing.attach(f"m{i}", _chat(f"system {i}", "hello"), None)
        chosen = router.choose(_view(f"m{i}"), now=float(i))
        assert chosen is not None
        counts[chosen.engine_id] += 1
        routing.detach(f"m{i}")
    assert set(counts) == set(ENGINES) and min(counts.values()) > 60


def test_block_size_follows_the_engine_s_scrape() -> None:
    fleet, _, routing = _setup()
    assert routing.index is not None and routing.index.block_size(ENGINES[0]) == 16
    fleet.record_state(ENGINES[0], EngineState(block_size=32, num_gpu_blocks=1000), now=0.0)
    assert routing.index.block_size(ENGINES[0]) == 32 and routing.index.block_size(ENGINES[1]) == 16


def test_gimbal_profile_through_the_router() -> None:
    fleet, router, routing = _setup("gimbal")
    for i, engine in enumerate(ENGINES):
        fleet.record_state(engine, EngineState(kv_usage=0.2 + 0.1 * i), now=0.0)
    key = affinity_key("tenant", user="alice")
    routing.attach("g1", None, key)
    first = router.choose(_view("g1"), now=0.0)
    assert first is not None
    routing.attach("g2", None, key)
    assert router.choose(_view("g2"), now=1.0) is first  # no engine over theta_kv: affinity
    # an engine at theta_kv with the others 0.1 below it: the emptiest cache wins, not the user's
    fleet.record_state(ENGINES[3], EngineState(kv_usage=0.95), now=2.0)
    routing.attach("g3", None, key)
    chosen = router.choose(_view("g3"), now=2.0)
    assert chosen is not None and chosen.engine_id == ENGINES[0]


def _hyperflexis_core(prefer: bool) -> tuple[Fleet, DispatchCore, PrefixRouting]:
    fleet = offline_fleet({MODEL: 4})
    routing = PrefixRouting(fleet, PrefixIndex(1 << 24, 120.0), None, track_in_use=prefer)
    router = Router(fleet, compile_profile({"scorers": [{"name": "least_load"}]}), routing)
    params = HyperFlexisParams(prefix_preference=prefer, budget_ttft_share=1.0)
    core = DispatchCore(
        fleet,
        router,
        make_order("slo_tpot", {}),
        lambda _: (DEFAULT_PREFILL, DEFAULT_DECODE),
        lambda _: ClassLimits(),
        hyperflexis=params,
    )
    return fleet, core, routing


def _ticket(rid: str, prompt: PromptBlocks, now: float) -> Ticket:
    view = RequestView(rid, MODEL, len(prompt), 20, arrival=now)
    item = QueuedRequest(view=view, ttft_slo=5.0, tpot_slo=0.2, seq=int(rid[1:]), queue_deadline=now + 30.0)
    return Ticket(item, "c", RunningEntry(len(prompt), 20, 0.2, now), now)


def test_hyperflexis_places_each_request_where_its_prefix_is_cached() -> None:
    # four conversations, each cached on a different engine (in reverse order of the engines);
    # every worker is held until t=1, so the four wait in the queue for one HyperFlexis turn
    prompts = {f"r{i}": _chat(SYSTEM + f" conversation {i} " * 40, f"question {i}") for i in range(4)}
    homes = {rid: ENGINES[3 - i] for i, rid in enumerate(prompts)}
    for prefer in (True, False):
        _, core, routing = _hyperflexis_core(prefer)
        assert routing.index is not None
        for rid, prompt in prompts.items():
            routing.index.record_dispatch(homes[rid], prompt, 0.0)
            routing.attach(rid, prompt, None)
        for engine in ENGINES:
            core.workers.set(MODEL, engine, 1.0)
        for rid, prompt in prompts.items():
            assert core.submit(_ticket(rid, prompt, 0.5), 0.5) is None  # queued
        core.step(1.0)
        placed = {rid: record.engine_id for rid, record in core.outbox}
        assert set(placed) == set(prompts)
        if prefer:
            assert placed == homes
        else:  # the same turn without the preference: queue order over the workers' order
            assert placed != homes
        # the index's approximate feed saw each choice: its own prompt is now cached where it went
        for rid, engine in placed.items():
            assert routing.index.cached_tokens(prompts[rid], [engine])[engine] >= len(prompts[rid]) - 16


def test_hyperflexis_prefix_profile_builds_an_index() -> None:
    from gateway.dispatch.build import RoutingProfile

    assert RoutingProfile.load(PROFILES / "hyperflexis-prefix.yaml").reads_prefix
    assert not RoutingProfile.load(PROFILES / "hyperflexis.yaml").reads_prefix


def expected_record(fleet: Fleet, engine_id: str) -> object:
    return fleet.records[engine_id]


def test_an_arrival_goes_to_the_mature_worker_holding_its_prefix() -> None:
    # an empty queue: the arrival is decided with one popped worker, which is not the holder;
    # the holder, mature too, joins the turn
    prompt = _chat(SYSTEM, "a question whose history lives on the last engine")
    for prefer, expected in ((True, ENGINES[3]), (False, None)):
        fleet, core, routing = _hyperflexis_core(prefer)
        assert routing.index is not None
        routing.index.record_dispatch(ENGINES[3], prompt, 0.0)
        routing.attach("r1", prompt, None)
        record = core.submit(_ticket("r1", prompt, 0.5), 0.5)
        assert record is not None
        if expected is not None:
            assert record.engine_id == expected
            # its reservation counts only the uncached part as waiting for prefill; KV it needs
            # whole (the cached blocks are free memory until a running request uses them)
            home = fleet.records[expected]
            waiting = home.unprefilled["r1"]
            assert waiting <= 16 < len(prompt)
            assert home.in_flight_tokens == len(prompt) + 20 and not home.shared
            # a second request with the same prompt while r1 runs there shares its blocks
            routing.attach("r2", prompt, None)
            record2 = core.submit(_ticket("r2", prompt, 0.6), 0.6)
            assert record2 is expected_record(fleet, expected)
            shared = home.shared["r2"]
            assert len(prompt) - 16 <= shared <= len(prompt)
            assert home.in_flight_tokens == 2 * (len(prompt) + 20) - shared
            for rid in ("r1", "r2"):
                fleet.release(expected, rid)
                routing.detach(rid)
            assert home.in_flight_tokens == 0 and not home.shared and not home.unprefilled
            assert not routing._in_use[expected]  # every use ended with its request
        else:
            assert record.engine_id != ENGINES[3]
            assert not fleet.records[record.engine_id].shared


def test_an_ejected_engine_loses_its_prefix_credit() -> None:
    """An engine ejected (crashed, restarted) kept the dispatch guesses of its old cache for the
    TTL: readmitted, it drew its old prompts back, to prefill them from scratch. What its KV events
    reported stays (a restart shows in the events themselves; a blip leaves the cache as it was)."""
    fleet, router, routing = _setup()
    prompt = _chat(SYSTEM, "what is the capital of france")
    routing.attach("r1", prompt, None)
    chosen = router.choose(_view("r1"), now=0.0)
    assert chosen is not None
    index = routing.index
    assert index is not None
    reported = _chat("another system prompt " * 20, "hello")
    tokens = [int(t) for t in reported.tokens]
    index.stored(chosen.engine_id, list(range(1, 1 + len(tokens) // 16)), None, tokens, 16, 0.0)
    assert index.match_reported(reported, [chosen.engine_id])[chosen.engine_id] == len(reported) // 16
    routing.attach("r2", prompt, None)
    cached = dict(routing.annotate(_view("r2"), fleet.candidates(MODEL), now=1.0).prefix.cached_tokens)  # type: ignore[union-attr]
    assert cached[chosen.engine_id] > 0
    fleet.eject(chosen.engine_id, "health check failed")  # a blip: no connection was refused
    fleet.record_health(chosen.engine_id, True, 1, 1)  # back
    assert fleet.records[chosen.engine_id].healthy
    cached = dict(routing.annotate(_view("r2"), fleet.candidates(MODEL), now=2.0).prefix.cached_tokens)  # type: ignore[union-attr]
    assert cached[chosen.engine_id] == 0
    assert index.match_reported(reported, [chosen.engine_id])[chosen.engine_id] == len(reported) // 16
    assert index.stats.cleared == 0  # (that counts the engine's own AllBlocksCleared)
    # refused connections: its process ended, and what its events said of its cache went with it
    # (kept, until the new process published, its old blocks drew their prompts to a cold engine)
    import time

    fleet.records[chosen.engine_id].adapter.refused_at = time.monotonic()
    fleet.eject(chosen.engine_id, "connection refused")
    fleet.record_health(chosen.engine_id, True, 1, 1)  # back (restarted)
    assert index.match_reported(reported, [chosen.engine_id])[chosen.engine_id] == 0


def test_a_prompt_past_the_token_cap_is_keyed_by_its_head_and_scored_as_a_share_of_the_whole() -> None:
    """4M characters of non-ASCII text are ~12M tokens: hashing and recording its 750K blocks
    held the loop for 0.3 s and, past the index's budget, evicted all the engine held. Keyed by
    its first MAX_PROMPT_TOKENS only, a match of that head is a share of the whole prompt, not
    all of it."""
    import numpy as np

    from gateway.fleet.prompt_key import MAX_PROMPT_TOKENS, prompt_blocks

    tokens = np.arange(2 * MAX_PROMPT_TOKENS, dtype=np.uint64) % 50_000
    blocks = prompt_blocks(MODEL, tokens)
    assert blocks is not None and len(blocks) == MAX_PROMPT_TOKENS
    assert blocks.prompt_tokens == 2 * MAX_PROMPT_TOKENS
    fleet, router, routing = _setup()
    routing.attach("r1", blocks, None)
    chosen = router.choose(_view("r1"), now=0.0)
    assert chosen is not None
    again = prompt_blocks(MODEL, tokens)
    routing.attach("r2", again, None)
    view = routing.annotate(_view("r2"), fleet.candidates(MODEL), now=1.0)
    assert view.prefix is not None and view.prefix.prompt_tokens == 2 * MAX_PROMPT_TOKENS
    assert dict(view.prefix.cached_tokens)[chosen.engine_id] == MAX_PROMPT_TOKENS  # half of it
