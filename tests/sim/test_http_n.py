"""``n`` > 1 over HTTP: n choices, one per chunk when streamed, each run by the engine model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.sim.helpers import MODEL, write_profile
from tests.sim.test_http_api import metric, post, stream
from tests.support.sim_process import SimProcess, start_sim_engine

CHAT = {"messages": [{"role": "user", "content": "give me options"}], "max_tokens": 6, "ignore_eos": True}


async def test_chat_non_stream_returns_n_distinct_choices(engine: SimProcess) -> None:
    url = engine.url + "/v1/chat/completions"
    status, body = await post(url, {**CHAT, "n": 3, "return_token_ids": True})
    assert status == 200, body
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 6 for c in choices)
    texts = [c["message"]["content"] for c in choices]
    assert len(set(texts)) == 3  # sampled choices differ
    _, single = await post(url, CHAT)
    assert texts[0] == single["choices"][0]["message"]["content"]  # choice 0 is the n=1 answer
    usage = body["usage"]
    assert usage["prompt_tokens"] == single["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == 18
    assert usage["total_tokens"] == usage["prompt_tokens"] + 18


async def test_stream_carries_one_choice_per_chunk_and_matches_non_stream(engine: SimProcess) -> None:
    url = engine.url + "/v1/completions"
    body: dict[str, Any] = {"prompt": "list three", "max_tokens": 5, "ignore_eos": True, "n": 2}
    _, full = await post(url, body)
    events, _, _ = await stream(url, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == {"done": True}
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert all(len(e["choices"]) == 1 for e in chunks)
    for index in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == full["choices"][index]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert mine[-1]["finish_reason"] == "length"  # nothing of a choice after its end


async def test_chat_stream_first_chunk_of_each_choice_has_the_role(engine: SimProcess) -> None:
    events, _, _ = await stream(engine.url + "/v1/chat/completions", {**CHAT, "n": 2})
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e.get("choices") and e["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in mine[1:])


async def test_sim_output_len_and_stop_apply_to_every_choice(engine: SimProcess) -> None:
    url = engine.url + "/v1/completions"
    _, body = await post(url, {"prompt": "x", "max_tokens": 50, "sim_output_len": 4, "n": 3})
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * 3
    assert body["usage"]["completion_tokens"] == 12


async def test_each_choice_takes_an_engine_slot(profiles_dir: Path) -> None:
    # 2 sequence slots and 20 ms per step: three choices of 80 tokens cannot all run at once
    path = write_profile(
        profiles_dir / "n-slots.yaml",
        max_num_seqs=2,
        latency={
            "prefill_a": 0.02,
            "prefill_b": 0.0,
            "prefill_c": 0.0,
            "decode_a": 0.02,
            "decode_b": 0.0,
            "decode_c": 0.0,
        },
    )
    with start_sim_engine("--profile", str(path), "--model", MODEL) as proc:
        url = proc.url + "/v1/completions"
        generated = await metric(proc.url, "vllm:generation_tokens_total")
        task = asyncio.create_task(
            post(url, {"prompt": "fan out", "max_tokens": 80, "ignore_eos": True, "n": 3})
        )
        await asyncio.sleep(0.3)
        running = await metric(proc.url, "vllm:num_requests_running")
        waiting = await metric(proc.url, "vllm:num_requests_waiting")
        status, body = await task
        assert len(body["choices"]) == 3
        assert status == 200
        assert (running, waiting) == (2, 1)
        assert await metric(proc.url, "vllm:generation_tokens_total") - generated == 240
        assert await metric(proc.url, "vllm:request_success_total", finished_reason="length") == 3


async def test_n_with_kv_transfer_is_refused(engine: SimProcess) -> None:
    status, body = await post(
        engine.url + "/v1/completions",
        {"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 400 and body["error"]["param"] == "n"
