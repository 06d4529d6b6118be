"""A completions batch (a list of prompts) over HTTP: ``n`` choices per prompt, as vLLM answers it."""

from __future__ import annotations

from typing import Any

from tests.sim.test_http_api import post, stream
from tests.support.sim_process import SimProcess

URL = "/v1/completions"
BATCH: dict[str, Any] = {"max_tokens": 4, "ignore_eos": True, "return_token_ids": True}


async def test_batch_answers_n_choices_per_prompt_in_prompt_order(engine: SimProcess) -> None:
    url = engine.url + URL
    status, body = await post(url, {**BATCH, "prompt": ["first prompt", [5, 6, 7]], "n": 2})
    assert status == 200, body
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    _, alone = await post(url, {**BATCH, "prompt": "first prompt"})
    first_ids = alone["choices"][0]["prompt_token_ids"]
    assert [c["prompt_token_ids"] for c in choices] == [first_ids, first_ids, [5, 6, 7], [5, 6, 7]]
    assert choices[0]["text"] == alone["choices"][0]["text"]  # sequence 0 of prompt 0 is the lone answer
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(first_ids) + 3  # each prompt once, not once per sequence
    assert usage["completion_tokens"] == 4 * 4


async def test_batch_streams_each_choice_to_its_end_with_the_batch_usage(engine: SimProcess) -> None:
    url = engine.url + URL
    body = {**BATCH, "prompt": ["a b", "c d e"], "stream_options": {"include_usage": True}}
    _, full = await post(url, {k: v for k, v in body.items() if k != "stream_options"})
    events, _, _ = await stream(url, body)
    assert events[-1] == {"done": True}
    usage, chunks = events[-2], events[:-2]
    assert usage["usage"] == full["usage"]
    for index in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == full["choices"][index]["text"]
        assert mine[0]["prompt_token_ids"] == full["choices"][index]["prompt_token_ids"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]


async def test_a_batch_with_an_empty_or_malformed_prompt_is_refused(engine: SimProcess) -> None:
    url = engine.url + URL
    for prompt in (["x", ""], [], ["x", 5], [[1, 2], []], ["x", [1, True]]):
        status, body = await post(url, {**BATCH, "prompt": prompt})
        assert status == 400, (prompt, body)
        assert body["error"]["param"] == "prompt"


async def test_a_batch_longer_than_the_context_is_refused_whole(engine: SimProcess) -> None:
    status, body = await post(engine.url + URL, {"prompt": ["short", [1] * 100_000], "max_tokens": 2})
    assert status == 400, body
    assert "maximum context length" in body["error"]["message"]
