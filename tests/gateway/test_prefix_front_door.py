"""The front door keys every request for the prefix index and the affinity store: the whole
prompt as the engine tokenizes it (vectorised encoder, per-message cache), the session key; a
live gateway with the engines' KV events routes a session's next turn to the engine holding its
history, and says so in ``x-slogate-decision`` when asked."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest

from gateway.bench.texts import english_text, non_ascii_text
from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.prompt_key import (
    MessageTokens,
    chat_token_ids,
    encode_array,
    prompt_blocks,
    prompt_token_ids,
    reference_token_ids,
)
from gateway.procs import ChildProcess, spawn_sim_engine
from gateway.tokenizer import encode
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry, free_port
from tests.gateway.gateway_thread import run_gateway, wait_until

_ALPHABET = "abcdefghijklmnopqrstuvwxyz    ABZ09,.\n<|>éü中🙂"
_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "|>")


def _random_text(rng: random.Random, n: int) -> str:
    parts = []
    while sum(map(len, parts)) < n:
        parts.append("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 40))))
        if rng.random() < 0.1:
            parts.append(rng.choice(_SPECIALS))
    return "".join(parts)


def test_the_vectorised_encoder_gives_the_tokenizer_s_ids() -> None:
    rng = random.Random(7)
    for n in [0, 1, 2, 3, 5, 50, 500]:
        for _ in range(300 if n < 100 else 30):
            text = _random_text(rng, n)
            assert encode_array(text).tolist() == encode(text), text
    # long texts go in pieces cut after a byte no token spans
    for text in (english_text(120_000, seed=3), non_ascii_text(90_000, seed=4), _random_text(rng, 80_000)):
        assert encode_array(text).tolist() == encode(text)
    assert encode_array("abcd" * 20_000).tolist() == encode("abcd" * 20_000)  # no safe cut at all


def test_a_chat_is_keyed_as_the_engine_renders_it_and_history_is_cached() -> None:
    cache = MessageTokens()
    system = english_text(3_000, seed=1)
    history = [
        {"role": "system", "content": system},
        {"role": "user", "content": english_text(2_000, seed=2)},
    ]
    first = chat_token_ids(history, cache)
    assert first.tolist() == reference_token_ids(history)
    assert cache.misses == 2 and cache.hits == 0
    turn = [
        *history,
        {"role": "assistant", "content": "sure"},
        {"role": "user", "content": english_text(900)},
    ]
    second = chat_token_ids(turn, cache)
    assert second.tolist() == reference_token_ids(turn)
    assert cache.hits == 2  # the history was not encoded again
    # multimodal-style content lists: the text parts, as the template joins them
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "text", "text": "here"}]}
    ]
    assert chat_token_ids(parts, cache).tolist() == reference_token_ids(parts)


def test_the_cache_stays_within_its_budget() -> None:
    cache = MessageTokens(budget_bytes=64_000)
    for i in range(50):
        chat_token_ids([{"role": "user", "content": english_text(2_000, seed=i)}], cache)
    assert 0 < cache.bytes <= 64_000


def test_the_cache_budget_counts_the_texts_that_key_it() -> None:
    # the key (the message's text) is most of what an entry holds: 1 byte a character for ASCII,
    # 2 for CJK, against about half a byte a character of uint16 token ids. Counting the token
    # arrays alone, the cache held several times its budget
    for text in (english_text(3_000, seed=1), "漢字かな交じり文の例です。" * 300):
        cache = MessageTokens(budget_bytes=200_000)
        for i in range(100):
            chat_token_ids([{"role": "user", "content": f"{i} {text}"}], cache)
        # (at least what the ids and the text's characters take)
        held = sum(tokens.nbytes + len(content) for (_, content), (tokens, _) in cache._entries.items())
        assert 0 < held <= cache.bytes <= 200_000


def test_the_cache_takes_back_what_it_counted_whatever_the_text_became() -> None:
    # a CJK string grows a UTF-8 copy the first time something asks for it (orjson sending the
    # body on): sizes read again at eviction took back more than was counted, and the count
    # drifted low until the cache held far more than its budget
    cache = MessageTokens(budget_bytes=100_000)
    for i in range(200):
        content = f"{i} " + "漢字かな交じり文の例です。" * 200
        chat_token_ids([{"role": "user", "content": content}], cache)
        orjson.dumps({"content": content})  # (as the request's body is sent on)
        assert 0 <= cache.bytes == sum(size for _, size in cache._entries.values()) <= 100_000


def test_prompt_ids_of_each_request_kind() -> None:
    messages = [{"role": "user", "content": "hello there"}]
    chat = prompt_token_ids("chat", {"messages": messages})
    assert chat is not None and chat.tolist() == reference_token_ids(messages)
    text = prompt_token_ids("completions", {"prompt": "once upon a time"})
    assert text is not None and text.tolist() == encode("once upon a time")
    ids = prompt_token_ids("completions", {"prompt": [5, 6, 7]})
    assert ids is not None and ids.tolist() == [5, 6, 7]
    assert prompt_token_ids("completions", {"prompt": [-1, 2]}) is None
    assert prompt_token_ids("embeddings", {"input": "x"}) is None
    # the same prompt keys the same blocks as the index's own tokens; cache_salt roots apart
    blocks = prompt_blocks(MODEL, chat)
    assert blocks is not None
    assert blocks.hashes(4) == PromptBlocks(np.array(reference_token_ids(messages)), root_key(MODEL)).hashes(
        4
    )
    salted = prompt_blocks(MODEL, chat, "tenant-a")
    assert salted is not None and salted.hashes(4)[0] != blocks.hashes(4)[0]


# -- live: a gateway, two simulated engines publishing KV events ----------------------------------


@pytest.fixture(scope="module")
def kv_engines() -> Iterator[list[tuple[ChildProcess, int]]]:
    ports = [free_port(), free_port()]
    with (
        spawn_sim_engine(*SIM_ARGS, "--kv-events-endpoint", f"tcp://*:{ports[0]}", name="e0") as e0,
        spawn_sim_engine(*SIM_ARGS, "--kv-events-endpoint", f"tcp://*:{ports[1]}", name="e1") as e1,
    ):
        yield [(e0, ports[0]), (e1, ports[1])]


def _decision(response: httpx.Response) -> dict[str, str]:
    header = response.headers["x-slogate-decision"]
    return dict(part.split("=", 1) for part in header.split("; "))


def test_a_session_s_next_turn_goes_where_its_history_is_cached(
    kv_engines: list[tuple[ChildProcess, int]],
) -> None:
    engines = [
        engine_entry(proc, kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kv")
        for proc, port in kv_engines
    ]
    with run_gateway(engines=engines, routing_profile="prefix-aware") as gw:
        prefix = gw.gateway.prefix
        assert prefix is not None and prefix.index is not None and prefix.affinity is not None
        feed = gw.gateway.kv_events
        assert feed is not None and set(feed.subscribers) == {"e0", "e1"}
        url = gw.url + "/v1/chat/completions"
        # both subscriptions reach their publishers before the test's request: ZMQ drops what is
        # published before (a loaded CI run lost the one event this test waits for)
        deadline, warm = time.monotonic() + 20, 0
        while (
            any(sub.stats.batches == 0 for sub in feed.subscribers.values()) and time.monotonic() < deadline
        ):
            warm += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"warm up {warm}"}],
                "max_tokens": 1,
            }
            assert httpx.post(url, json=body).status_code == 200
            time.sleep(0.05)
        assert all(sub.stats.batches > 0 for sub in feed.subscribers.values())
        system = english_text(4_000, seed=11)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "what now"}]
        debug = {"x-slogate-debug": "1", "x-session-id": "s-1"}
        r = httpx.post(url, json={"model": MODEL, "messages": messages, "max_tokens": 4}, headers=debug)
        assert r.status_code == 200
        first = _decision(r)
        assert first["policy"] == "prefix-aware" and first["engine"] in ("e0", "e1")
        assert first["cached_tokens"].startswith("0/")
        assert {"prefix_match", "session_affinity", "least_load", "kv_utilisation", "total"} <= set(first)
        engine = first["engine"]
        tokens = np.array(reference_token_ids(messages), dtype=np.uint64)
        blocks = PromptBlocks(tokens, root_key(MODEL))
        # the engine's own events say it holds the prompt: the index has them as precise entries
        assert wait_until(lambda: feed.subscribers[engine].stats.batches > 0, timeout=10)
        assert wait_until(lambda: prefix.index is not None and prefix.index.stats.stored > 0, timeout=10)
        held = prefix.index.match(blocks, [engine])[engine]
        assert held == len(tokens) // prefix.index.block_size(engine)
        # the next turn of the session: same engine, its history counted as cached
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then"}]
        r = httpx.post(url, json={"model": MODEL, "messages": messages, "max_tokens": 4}, headers=debug)
        second = _decision(r)
        assert second["engine"] == engine and second["session_engine"] == engine
        cached, total = map(int, second["cached_tokens"].split("/"))
        assert cached >= len(tokens) - prefix.index.block_size(engine) and total > cached
        assert float(second["prefix_match"]) > 0.5 and float(second["session_affinity"]) == 1.0
        # no header without the debug flag
        r = httpx.post(url, json={"model": MODEL, "messages": messages, "max_tokens": 4})
        assert "x-slogate-decision" not in r.headers
        text = httpx.get(gw.url + "/metrics").text
        assert f'slogate_prefix_routed_requests_total{{engine="{engine}",match="partial"}}' in text
        assert 'slogate_affinity_routed_requests_total{outcome="kept"}' in text
        assert "slogate_prefix_index_bytes" in text
    assert all(s._task is None for s in feed.subscribers.values())  # stopped with the app


def test_one_api_key_is_not_one_session(kv_engines: list[tuple[ChildProcess, int]]) -> None:
    """An application sends all its users' requests with one key: without a session id or a
    user, they are no session (keyed by the key, each request stuck to the engine the last one
    went to, every request of the app on one engine until the imbalance guard gave way)."""
    engines = [engine_entry(proc) for proc, _ in kv_engines]
    with run_gateway(engines=engines, routing_profile="prefix-aware", api_keys=["sk-app-0123456789"]) as gw:
        url = gw.url + "/v1/chat/completions"
        headers = {"authorization": "Bearer sk-app-0123456789", "x-slogate-debug": "1"}
        chosen = []
        for i in range(12):  # distinct prompts, one at a time: every engine idle, every one a miss
            messages = [{"role": "user", "content": english_text(300, seed=100 + i)}]
            r = httpx.post(url, json={"model": MODEL, "messages": messages, "max_tokens": 2}, headers=headers)
            assert r.status_code == 200, r.text
            decision = _decision(r)
            assert "session_engine" not in decision and float(decision["session_affinity"]) == 0.0
            chosen.append(decision["engine"])
        assert set(chosen) == {"e0", "e1"}, chosen  # ties broken at random, not by the key
        # a session the client names still sticks, with the key as without it
        session = {**headers, "x-session-id": "chat-1"}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        first = _decision(httpx.post(url, json=body, headers=session))["engine"]
        for _ in range(3):
            assert _decision(httpx.post(url, json=body, headers=session))["engine"] == first


def test_a_body_parsed_in_the_worker_brings_its_prompt_ids() -> None:
    import orjson

    from gateway.api.request_parse import parse_summary

    messages = [{"role": "user", "content": english_text(5_000)}]
    raw = orjson.dumps({"model": MODEL, "messages": messages, "user": "alice", "cache_salt": "t"})
    summary = parse_summary("chat", raw, 16, prompt_ids=True)
    assert summary.parsed is None and summary.user == "alice" and summary.cache_salt == "t"
    assert summary.prompt_ids is not None and summary.prompt_ids.tolist() == reference_token_ids(messages)
    assert parse_summary("chat", raw, 16).prompt_ids is None


def _hashed(metrics_text: str) -> float:
    line = next(x for x in metrics_text.splitlines() if x.startswith("slogate_prefix_hash_seconds_count"))
    return float(line.rsplit(" ", 1)[1])


def test_a_request_for_a_model_nobody_serves_is_refused_before_its_prompt_is_keyed(
    kv_engines: list[tuple[ChildProcess, int]],
) -> None:
    """Hashing the prompt of a request that will get a 404 is the loop's time spent on a client's
    mistake (a 200 KB prompt costs milliseconds to key)."""
    engines = [engine_entry(proc) for proc, _ in kv_engines]
    with run_gateway(engines=engines, routing_profile="prefix-aware") as gw:
        url = gw.url + "/v1/chat/completions"
        prompt = [{"role": "user", "content": english_text(20_000, seed=5)}]
        ok = httpx.post(url, json={"model": MODEL, "messages": prompt, "max_tokens": 1})
        assert ok.status_code == 200
        before = _hashed(httpx.get(gw.url + "/metrics").text)
        assert before >= 1  # (keyed: the series this test reads counts every keyed prompt)
        r = httpx.post(url, json={"model": "no-such-model", "messages": prompt, "max_tokens": 1})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert MODEL in error["message"]  # the models that are served, named
        # a malformed SLO header is still the answer it was (the header is read first)
        bad = httpx.post(
            url, json={"model": "no-such-model", "messages": prompt}, headers={"x-priority": "--1"}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-priority", bad.text
        assert _hashed(httpx.get(gw.url + "/metrics").text) == before


def test_tools_and_tool_calls_are_keyed_as_the_template_writes_them() -> None:
    """The template writes the request's tools as a system turn ahead of the messages and an
    assistant turn's calls after its content (the simulated engine's prompt and KV blocks have
    them): keyed without them, every agent turn's key missed the blocks its engine held."""
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": {}}},
        }
        for i in range(20)
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "tool_3", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": english_text(500, seed=3)},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    cache = MessageTokens()
    keyed = chat_token_ids(messages, cache, tools)
    assert keyed.tolist() == reference_token_ids(messages, tools)
    assert len(keyed) > len(reference_token_ids(messages)) + 20 * 10  # (the tools are in it)
    body = {"messages": messages, "tools": tools}
    chat = prompt_token_ids("chat", body)
    assert chat is not None and chat.tolist() == reference_token_ids(messages, tools)
    # the next turn sends the same tools: its key starts with this one's
    turn = [*messages, {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    hits = cache.hits
    again = chat_token_ids(turn, cache, tools)
    assert again.tolist() == reference_token_ids(turn, tools) and cache.hits > hits
    assert again[: len(keyed) - 3].tolist() == keyed[: len(keyed) - 3].tolist()
    # tools the template cannot write: not keyed (the engine refuses such a body)
    deep: object = "x"
    for _ in range(300):
        deep = [deep]
    assert prompt_token_ids("chat", {"messages": messages, "tools": [deep]}) is None
    assert prompt_token_ids("chat", {"messages": [{"role": "assistant", "tool_calls": [deep]}]}) is None
