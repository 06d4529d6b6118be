"""The prefix index: both feeds, lookups, TTL, and its memory bound measured."""

from __future__ import annotations

import random

import numpy as np

from gateway.bench.prefix_memory import fill
from gateway.fleet.block_hash import PromptBlocks, chain, root_key
from gateway.fleet.prefix_index import GENERATIONS, PrefixIndex

BS = 16
ROOT = root_key("m")


def _tokens(seed: int, blocks: int, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 152_000) for _ in range(blocks * BS + extra)]


def _index(*engines: str, budget: int = 1 << 26, ttl: float = 60.0) -> PrefixIndex:
    index = PrefixIndex(budget, ttl)
    for e in engines:
        index.add_engine(e, "m", BS)
    return index


def _store(
    index: PrefixIndex, engine: str, tokens: list[int], parent: int | None, now: float = 0.0
) -> list[int]:
    """Feed a BlockStored as an engine would, with the engine's own (arbitrary) hashes."""
    hashes = [
        hash(("engine", engine, parent, i, tuple(tokens[:BS]))) & ((1 << 64) - 1)
        for i in range(len(tokens) // BS)
    ]
    index.stored(engine, hashes, parent, tokens, BS, now)
    return hashes


# -- approximate feed ---------------------------------------------------------------------------


def test_dispatch_marks_the_prompt_on_that_engine_only() -> None:
    index = _index("a", "b")
    system = _tokens(1, 8)
    first = PromptBlocks(system + _tokens(2, 3, extra=5), ROOT)
    index.record_dispatch("a", first, now=0.0)
    assert index.match(first, ["a", "b", "unknown"]) == {"a": 11, "b": 0, "unknown": 0}
    # another user turn behind the same system prompt: its 8 blocks are there, its own are not
    second = PromptBlocks(system + _tokens(3, 4), ROOT)
    assert index.match(second, ["a", "b"]) == {"a": 8, "b": 0}
    assert index.cached_tokens(second, ["a"]) == {"a": 8 * BS}
    # the same tokens under another root (LoRA adapter, cache_salt) share nothing
    assert index.match(PromptBlocks(system, root_key("m", None, "tenant-2")), ["a"]) == {"a": 0}


def test_dispatch_guesses_expire_after_the_ttl() -> None:
    index = _index("a", ttl=10.0)
    old = PromptBlocks(_tokens(1, 4), ROOT)
    new = PromptBlocks(_tokens(2, 4), ROOT)
    index.record_dispatch("a", old, now=0.0)
    index.record_dispatch("a", new, now=9.0)
    assert index.expire(9.5) == 0
    # the TTL passes a generation at a time (an eighth of the TTL): old goes, new stays
    assert index.expire(10.0 + 10.0 / 8) == 4
    assert index.match(old, ["a"]) == {"a": 0} and index.match(new, ["a"]) == {"a": 4}
    # a new dispatch refreshes: the prompt lives a TTL from its last use
    index.record_dispatch("a", new, now=18.0)
    index.expire(25.0)
    assert index.match(new, ["a"]) == {"a": 4}
    index.expire(30.0)
    assert index.match(new, ["a"]) == {"a": 0}


# -- precise feed -------------------------------------------------------------------------------


def test_stored_events_are_rehashed_from_their_tokens() -> None:
    index = _index("a")
    tokens = _tokens(5, 6)
    hashes = _store(index, "a", tokens[: 4 * BS], None)
    # a later event continues from the engine's hash of block 3
    _store(index, "a", tokens[4 * BS :], hashes[-1])
    assert index.match(PromptBlocks(tokens, ROOT), ["a"]) == {"a": 6}
    assert index.match(PromptBlocks(tokens[: 5 * BS], ROOT), ["a"]) == {"a": 5}
    assert index.stats.stored == 6


def test_match_reported_counts_what_the_events_said_only() -> None:
    index = _index("a")
    tokens = _tokens(13, 6)
    prompt = PromptBlocks(tokens, ROOT)
    _store(index, "a", tokens[: 2 * BS], None)  # the engine reported two blocks
    index.record_dispatch("a", prompt, now=0.0)  # the gateway guesses all six
    assert index.match(prompt, ["a"]) == {"a": 6}
    assert index.match_reported(prompt, ["a", "unknown"]) == {"a": 2, "unknown": 0}
    index.drop_precise("a")
    assert index.match_reported(prompt, ["a"]) == {"a": 0}


def test_stored_under_a_lora_or_salt_root() -> None:
    index = _index("a")
    tokens = _tokens(6, 3)
    index.stored("a", [1, 2, 3], None, tokens, BS, 0.0, lora="ad", cache_salt="s")
    assert index.match(PromptBlocks(tokens, root_key("m", "ad", "s")), ["a"]) == {"a": 3}
    assert index.match(PromptBlocks(tokens, ROOT), ["a"]) == {"a": 0}


def test_unknown_parent_and_block_size_are_left_out() -> None:
    index = _index("a")
    tokens = _tokens(7, 2)
    assert index.stored("a", [1, 2], 999, tokens, BS, 0.0) == 0
    assert index.stats.orphans == 2
    assert index.stored("a", [1], None, tokens, 32, 0.0) == 0
    assert index.stats.block_size_mismatch == 1
    assert index.entries() == 0


def test_removed_blocks_go_whichever_feed_wrote_them() -> None:
    index = _index("a")
    tokens = _tokens(8, 5)
    prompt = PromptBlocks(tokens, ROOT)
    index.record_dispatch("a", prompt, now=0.0)  # the guess comes first
    hashes = _store(index, "a", tokens, None, now=0.1)  # then the engine's word
    assert index.match(prompt, ["a"]) == {"a": 5}
    assert index.removed("a", [hashes[3], 12345]) == 1
    assert index.match(prompt, ["a"]) == {"a": 3}  # the engine evicted block 3: 0-2 lead
    index.removed("a", hashes[:1])
    assert index.match(prompt, ["a"]) == {"a": 0}


def test_cleared_and_resync() -> None:
    index = _index("a")
    guessed = PromptBlocks(_tokens(9, 3), ROOT)
    reported = _tokens(10, 3)
    index.record_dispatch("a", guessed, now=0.0)
    _store(index, "a", reported, None)
    index.drop_precise("a")  # a sequence gap: the events' word is void, the guesses stay
    assert index.match(guessed, ["a"]) == {"a": 3}
    assert index.match(PromptBlocks(reported, ROOT), ["a"]) == {"a": 0}
    index.cleared("a")  # the engine's cache is empty: so is every guess about it
    assert index.match(guessed, ["a"]) == {"a": 0} and index.entries() == 0
    assert index.bytes_used == 0


def test_a_dispatch_keeps_reported_blocks_fresh() -> None:
    """A prefix the engine reported long ago and every request still uses is copied into the
    newest generation, so eviction of old generations never takes it."""
    index = PrefixIndex(1 << 30, 60.0)
    index.add_engine("a", "m", BS)
    index._generation_entries = 8  # tiny generations for the test
    system = _tokens(11, 4)
    _store(index, "a", system, None)
    for i in range(20):  # other reports fill new generations
        _store(index, "a", _tokens(100 + i, 4), None, now=float(i))
        index.record_dispatch("a", PromptBlocks(system + _tokens(200 + i, 1), ROOT), now=float(i))
    while len(index._engines["a"].precise) > 2:  # evict all but the two newest generations
        index.budget_bytes = index.bytes_used - 1
        index._enforce()
    # still what the engine reported (as a dispatch guess it would match too, but as a guess:
    # no longer the engine's own word, and gone with the guesses' time to live)
    assert index.match_reported(PromptBlocks(system, ROOT), ["a"]) == {"a": 4}


def test_set_block_size_drops_the_engine_s_keys() -> None:
    index = _index("a")
    prompt = PromptBlocks(_tokens(12, 4), ROOT)
    index.record_dispatch("a", prompt, now=0.0)
    index.add_engine("a", "m", BS)  # same size: nothing changes
    assert index.match(prompt, ["a"]) == {"a": 4}
    index.set_block_size("a", 32)
    assert index.match(prompt, ["a"]) == {"a": 0} and index.block_size("a") == 32
    index.record_dispatch("a", prompt, now=0.0)
    assert index.match(prompt, ["a"]) == {"a": 2}


def test_a_200kb_prompt_held_whole_on_4_engines_matches_whole_on_each() -> None:
    """The lookup's worst case, every engine holding the whole prompt (its cost is a figure of
    ``slogate bench large-body --key-only``, not a timed test)."""
    tokens = _tokens(13, 3571)  # ~200 KB of text
    index = _index("a", "b", "c", "d", budget=1 << 28)
    for e in "abcd":
        index.record_dispatch(e, PromptBlocks(tokens, ROOT), now=0.0)
    prompt = PromptBlocks(tokens, ROOT)
    assert index.match(prompt, "abcd") == dict.fromkeys("abcd", 3571)
    index.record_dispatch("a", prompt, now=1.0)
    assert index.match(PromptBlocks(tokens, ROOT), "abcd") == dict.fromkeys("abcd", 3571)


# -- memory ---------------------------------------------------------------------------------------


# (the index's memory against its budget, measured: ``slogate bench prefix-memory``, whose smoke
# run in tests/gateway/test_bench_smoke.py holds it to its checks)


def test_a_quiet_engine_keeps_its_share() -> None:
    index = _index("busy", "quiet", budget=4 << 20)
    quiet = PromptBlocks(_tokens(14, 64), ROOT)
    index.record_dispatch("quiet", quiet, now=0.0)
    fill(index, ("busy",), 200_000, "dispatches", np.random.default_rng(0), 0)
    assert index.match(quiet, ["quiet"]) == {"quiet": 64}
    assert index.bytes_used <= 4 << 20 and index.stats.evicted > 0


def test_chain_helper_is_the_index_s_key() -> None:
    tokens = _tokens(15, 3)
    index = _index("a")
    index.record_dispatch("a", PromptBlocks(tokens, ROOT), now=0.0)
    keys = chain(tokens, BS, ROOT)
    assert all(k in index._engines["a"].approx[-1].keys for k in keys)


def test_events_before_the_first_scrape_take_the_block_size_they_carry() -> None:
    """Events can come before the first scrape reports the engine's block size (the replay of
    its cache at subscription): they were dropped as a mismatch against the default, and every
    block chained on them later was an orphan."""
    from gateway.fleet.kv_events import Stored, apply_events

    size = 32
    index = PrefixIndex(1 << 24, 60.0)
    index.add_engine("e", "m", None)  # no scrape yet: the default size
    tokens = list(range(1000, 1000 + 4 * size))
    apply_events(index, "e", [Stored([11, 12], None, tokens[: 2 * size], size, None, None)], 0.0)
    index.set_block_size("e", size)  # the scrape agrees
    apply_events(index, "e", [Stored([13, 14], 12, tokens[2 * size :], size, None, None)], 1.0)
    assert index.match(PromptBlocks(tokens, root_key("m", None, None)), ["e"])["e"] == 4
    assert index.stats.orphans == 0 and index.stats.block_size_mismatch == 0
    # once the engine has said its size, an event of another size is a mismatch
    apply_events(index, "e", [Stored([15], None, tokens[:16], 16, None, None)], 2.0)
    assert index.stats.block_size_mismatch == 1


# -- generations: how many an engine holds -----------------------------------------------------


class _CountingDict(dict):  # type: ignore[type-arg]
    """Counts the lookups and pops the index makes in the generations it wraps."""

    ops = 0

    def __contains__(self, key: object) -> bool:
        _CountingDict.ops += 1
        return dict.__contains__(self, key)

    def pop(self, *args: object) -> object:  # type: ignore[override]
        _CountingDict.ops += 1
        return dict.pop(self, *args)


def _busy_engine_among(engines: int) -> tuple[PrefixIndex, list[int]]:
    """Engine e0's events report 200 prompts of 1,000 blocks (~40 MB of a 64 MB budget); the
    other engines are idle. Returns the index and each prompt's first engine hash."""
    index = _index(*(f"e{i}" for i in range(engines)))
    rng = np.random.default_rng(0)
    firsts = []
    for c in range(200):
        tokens = rng.integers(0, 152_000, 1000 * BS).tolist()
        hashes = list(range(1 + c * 1000, 1 + (c + 1) * 1000))
        index.stored("e0", hashes, None, tokens, BS, now=float(c))
        firsts.append(hashes[0])
    return index, firsts


def test_a_busy_engine_s_generations_do_not_multiply_with_the_fleet() -> None:
    """Generations were sized to an even share of the budget: among 63 idle engines, one busy
    engine's 200,000 blocks took 600 generations, and every dispatch (copying reported blocks
    forward) and every BlockRemoved walked them all: 18x the dict operations of the same engine
    alone. Now an engine keeps at most two per sixteenth of its entries whatever the fleet."""
    costs = {}
    for engines in (1, 64):
        index, firsts = _busy_engine_among(engines)
        precise = index._engines["e0"].precise
        assert len(precise) <= 2 * GENERATIONS, len(precise)
        assert index.entries("e0") == 200_000 and index.stats.evicted == 0  # (merges lose nothing)
        for gen in precise:
            gen.keys, gen.by_engine_hash = _CountingDict(gen.keys), _CountingDict(gen.by_engine_hash)
        _CountingDict.ops = 0
        rng = np.random.default_rng(1)
        index.record_dispatch("e0", PromptBlocks(rng.integers(0, 152_000, 2000 * BS), ROOT), now=300.0)
        assert index.removed("e0", firsts[:100]) == 100
        costs[engines] = _CountingDict.ops
    assert costs[64] <= 4 * costs[1], costs


def test_generations_an_engine_s_cache_evicted_go_and_the_rest_still_match() -> None:
    """An engine's cache churns: blocks its events stored long ago are evicted. The generations
    that held them go (they stayed, empty, walked by every call), generations merged past the cap
    still answer for every block they took in, and the byte count stays exact through both."""
    index = _index("a")
    index._generation_entries = 8  # tiny generations: many, merged
    prompts = [_tokens(500 + i, 4) for i in range(150)]
    hashes = [_store(index, "a", p, None, now=float(i)) for i, p in enumerate(prompts)]
    gens = index._engines["a"].precise
    assert index.stats.merged_generations > 0 and len(gens) <= 32
    assert all(index.match(PromptBlocks(p, ROOT), ["a"]) == {"a": 4} for p in prompts)
    assert index.bytes_used == sum(g.measure() for g in gens)
    before = len(gens)
    for h in hashes[:140]:
        index.removed("a", h)
    assert len(index._engines["a"].precise) < before and index.entries("a") == 40
    assert all(index.match(PromptBlocks(p, ROOT), ["a"]) == {"a": 0} for p in prompts[:140])
    assert all(index.match(PromptBlocks(p, ROOT), ["a"]) == {"a": 4} for p in prompts[140:])
    assert index.bytes_used == sum(g.measure() for g in index._engines["a"].precise)
