"""The sim engine's Responses API (``/v1/responses``) against vLLM 0.33's wire format, with the openai
SDK and raw HTTP: bodies, the SSE stream, the store (retrieve, continuation, cancel, background),
validation, faults, and agreement with a chat request holding the same messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from gateway.sim.cli import build_parser
from gateway.sim.responses_store import ResponseStore, StoredResponse
from tests.sim.helpers import MODEL
from tests.sim.test_http_api import metric, post
from tests.support.sim_process import SimProcess, start_sim_engine

#: ResponsesResponse's fields as vLLM 0.33 writes them, in its order
VLLM_RESPONSE_FIELDS = [
    "id",
    "created_at",
    "incomplete_details",
    "instructions",
    "metadata",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
    "status",
    "text",
    "top_logprobs",
    "truncation",
    "usage",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "kv_transfer_params",
    "ec_transfer_params",
    "input_messages",
    "output_messages",
]
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def store_off() -> Iterator[SimProcess]:
    """An engine without the store, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE."""
    args = ("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "10", "--responses-store-size", "0")
    with start_sim_engine(*args) as proc:
        yield proc


@pytest.fixture
async def client(engine: SimProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


async def chat(url: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    status, body = await post(
        url + "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra},
    )
    assert status == 200, body
    return body  # type: ignore[no-any-return]


async def raw_sse(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[bytes, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.read(), r.headers["Content-Type"]


def parse_sse(raw: bytes) -> list[tuple[str, bytes]]:
    """(event name, data bytes) per event; asserts the framing vLLM writes."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw[:-2].split(b"\n\n"):
        head, data = block.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: "), block
        events.append((head[7:].decode(), data[6:]))
    return events


async def wait_for(url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 5
    while await metric(url, name) != value and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert await metric(url, name) == value


# -- bodies -----------------------------------------------------------------------------------


async def test_a_response_is_what_a_chat_with_the_same_messages_answers(
    engine: SimProcess, client: openai.AsyncOpenAI
) -> None:
    first = await client.responses.create(
        model=MODEL,
        input="an unusual question about rivers",
        instructions="answer in three words",
        max_output_tokens=7,
        extra_body={"ignore_eos": True},
    )
    messages = [
        {"role": "system", "content": "answer in three words"},
        {"role": "user", "content": "an unusual question about rivers"},
    ]
    reply = await chat(engine.url, messages, 7)
    assert first.output_text == reply["choices"][0]["message"]["content"] != ""
    assert first.usage is not None
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert first.usage.input_tokens == prompt_tokens and first.usage.output_tokens == 7
    assert first.usage.total_tokens == prompt_tokens + 7
    # first sight of the prompt: nothing cached, its full blocks written
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.input_tokens_details.model_dump()["cache_write_tokens"] == prompt_tokens // 16 * 16
    assert first.status == "incomplete" and first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.id.startswith("resp_") and first.object == "response" and first.model == MODEL
    assert first.max_output_tokens == 7 and first.temperature == 1.0 and first.top_p == 1.0
    assert first.instructions == "answer in three words" and first.background is False
    [item] = first.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    assert [(p.type, getattr(p, "annotations", None)) for p in item.content] == [("output_text", [])]
    # the prefix cache is shared with chat requests: the same prompt again hits it the same way
    again = await client.responses.create(
        model=MODEL,
        input="an unusual question about rivers",
        instructions="answer in three words",
        max_output_tokens=7,
        extra_body={"ignore_eos": True},
    )
    reply_again = await chat(engine.url, messages, 7)
    assert again.usage is not None and again.output_text == first.output_text
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached == reply_again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_natural_end_is_completed(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model=MODEL, input="say five words", max_output_tokens=50, extra_headers={"X-Sim-Output-Len": "5"}
    )
    assert response.status == "completed" and response.incomplete_details is None
    assert response.usage is not None and response.usage.output_tokens == 5
    assert response.max_output_tokens == 50


async def test_the_body_has_vllms_fields_in_vllms_order(engine: SimProcess) -> None:
    body = {
        "model": MODEL,
        "input": "order please",
        "max_output_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
        "user": "u1",
        "reasoning": {"effort": "low"},
        "request_id": "resp_fixed_id",
    }
    status, answer = await post(engine.url + "/v1/responses", body)
    assert status == 200
    assert list(answer) == VLLM_RESPONSE_FIELDS
    assert answer["id"] == "resp_fixed_id" and answer["metadata"] == {"k": "v"} and answer["user"] == "u1"
    assert (answer["temperature"], answer["top_p"], answer["tool_choice"]) == (0.5, 0.9, "none")
    assert answer["reasoning"] == {
        "context": None,
        "effort": "low",
        "generate_summary": None,
        "mode": None,
        "summary": None,
    }
    assert list(answer["usage"]) == [
        "input_tokens",
        "input_tokens_details",
        "output_tokens",
        "output_tokens_details",
        "total_tokens",
    ]
    assert answer["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0,
        "tool_output_tokens": 0,
        "output_tokens_per_turn": [],
        "tool_output_tokens_per_turn": [],
    }
    assert list(answer["output"][0]) == ["id", "content", "role", "status", "type", "phase"]
    assert answer["output"][0]["content"][0]["logprobs"] is None
    # greedy: vLLM resets top_p, and raises a tiny temperature to 0.01
    _, greedy = await post(engine.url + "/v1/responses", {**body, "temperature": 0, "request_id": "resp_g"})
    assert (greedy["temperature"], greedy["top_p"]) == (0.0, 1.0)
    _, tiny = await post(engine.url + "/v1/responses", {**body, "temperature": 0.001, "request_id": "resp_t"})
    assert tiny["temperature"] == 0.01


# -- streaming ----------------------------------------------------------------------------------


async def test_a_stream_through_the_sdk(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model=MODEL,
        input="stream me a line",
        max_output_tokens=9,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    # (Any: the SDK types each event as the union of all of them)
    events: list[Any] = [event async for event in stream]
    assert [e.type for e in events] == [*OPENING, *["response.output_text.delta"] * 9, *CLOSING]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, in_progress, added, part_added, *deltas, text_done, part_done, item_done, completed = events
    assert created.response.status == in_progress.response.status == "in_progress"
    assert created.response.output == [] and created.response.usage is None
    text = "".join(d.delta for d in deltas)
    assert text_done.text == text and part_done.part.text == text
    item_id = added.item.id
    assert {part_added.item_id, text_done.item_id, item_done.item.id} == {item_id}
    final = completed.response
    assert final.status == "incomplete" and final.output_text == text and final.output[0].id == item_id
    assert final.usage is not None and final.usage.output_tokens == 9
    # the same request unstreamed says the same
    whole = await client.responses.create(
        model=MODEL, input="stream me a line", max_output_tokens=9, extra_body={"ignore_eos": True}
    )
    assert whole.output_text == text and whole.usage is not None
    assert whole.usage.input_tokens == final.usage.input_tokens


async def test_the_sse_framing_is_vllms(engine: SimProcess) -> None:
    raw, content_type = await raw_sse(
        engine.url + "/v1/responses",
        {"model": MODEL, "input": "frame check", "max_output_tokens": 4, "ignore_eos": True, "stream": True},
    )
    assert content_type.startswith("text/event-stream")
    assert b"[DONE]" not in raw  # (vLLM ends a responses stream with response.completed alone)
    events = parse_sse(raw)
    assert [name for name, _ in events] == [*OPENING, *["response.output_text.delta"] * 4, *CLOSING]
    datas = [orjson.loads(data) for _, data in events]
    for (name, data), parsed in zip(events, datas, strict=True):
        assert orjson.dumps(parsed) == data  # compact, no spaces, as pydantic's model_dump_json
        assert parsed["type"] == name
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    # an event's own keys in alphabetical order, as the openai models vLLM dumps have them
    delta = datas[4]
    assert list(delta) == [
        "content_index",
        "delta",
        "item_id",
        "logprobs",
        "output_index",
        "sequence_number",
        "type",
    ]
    assert (delta["content_index"], delta["output_index"], delta["logprobs"]) == (0, 0, [])
    assert list(datas[0]) == ["response", "sequence_number", "type"]
    assert list(datas[0]["response"]) == VLLM_RESPONSE_FIELDS
    assert list(datas[-4]) == [
        "content_index",
        "item_id",
        "logprobs",
        "output_index",
        "sequence_number",
        "text",
        "type",
    ]
    assert datas[3]["part"] == {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    assert datas[-3]["part"]["logprobs"] is None
    final = datas[-1]["response"]
    assert final["usage"]["output_tokens"] == 4 and final["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == datas[-4]["text"]


async def test_a_stream_that_produces_no_text_has_no_message(engine: SimProcess) -> None:
    """A stop string at the very start: vLLM opens no output item and completes with none."""
    raw, _ = await raw_sse(
        engine.url + "/v1/responses",
        {"input": "frame check", "max_output_tokens": 4, "ignore_eos": True, "stream": True, "stop": [" "]},
    )
    events = parse_sse(raw)
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.completed"]
    final = orjson.loads(events[-1][1])["response"]
    assert final["output"] == [] and final["status"] == "completed" and final["usage"]["output_tokens"] == 1


# -- the store ----------------------------------------------------------------------------------


async def test_a_stored_response_is_retrieved_as_it_was_answered(client: openai.AsyncOpenAI) -> None:
    created = await client.responses.create(model=MODEL, input="keep this", max_output_tokens=4)
    got = await client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    stream = await client.responses.create(model=MODEL, input="keep that", max_output_tokens=4, stream=True)
    events: list[Any] = [e async for e in stream]
    final = events[-1].response
    assert (await client.responses.retrieve(final.id)).model_dump() == final.model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.retrieve("resp_nowhere")
    assert caught.value.body == {
        "message": "Response with id 'resp_nowhere' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }


async def test_previous_response_id_continues_the_conversation(
    engine: SimProcess, client: openai.AsyncOpenAI
) -> None:
    one = await client.responses.create(
        model=MODEL, input="the first question", instructions="be brief", max_output_tokens=6
    )
    two = await client.responses.create(
        model=MODEL,
        input="the second question",
        instructions="be terse",  # instructions do not carry over: the new ones lead
        previous_response_id=one.id,
        max_output_tokens=6,
    )
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "the first question"},
        {"role": "assistant", "content": one.output_text},
        {"role": "user", "content": "the second question"},
    ]
    reply = await chat(engine.url, [{"role": "system", "content": "be terse"}, *history], 6)
    assert two.previous_response_id == one.id
    assert two.usage is not None and two.usage.input_tokens == reply["usage"]["prompt_tokens"]
    assert two.output_text == reply["choices"][0]["message"]["content"]
    three = await client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "the third question"}]}],
        previous_response_id=two.id,
        max_output_tokens=6,
    )
    messages: list[dict[str, Any]] = [
        *history,
        {"role": "assistant", "content": two.output_text},
        {"role": "user", "content": [{"type": "text", "text": "the third question"}]},
    ]
    reply = await chat(engine.url, messages, 6)
    assert three.usage is not None and three.usage.input_tokens == reply["usage"]["prompt_tokens"]
    assert three.output_text == reply["choices"][0]["message"]["content"]
    # the blocks the response wrote to the prefix cache are the ones the same chat reads
    written = three.usage.input_tokens_details.model_dump()["cache_write_tokens"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == written > 0


async def test_input_items_become_the_chat_messages_vllm_builds(
    engine: SimProcess, client: openai.AsyncOpenAI
) -> None:
    items: list[Any] = [
        {"type": "message", "role": "developer", "content": "use tools"},
        {"role": "user", "content": "what is the weather"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "it rains"}]},
        {"role": "user", "content": "thanks"},
    ]
    response = await client.responses.create(model=MODEL, input=items, max_output_tokens=3)
    call = {"id": "c1", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}, "type": "function"}
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "use tools"},
        {"role": "user", "content": "what is the weather"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
        {"role": "assistant", "content": "it rains"},
        {"role": "user", "content": "thanks"},
    ]
    reply = await chat(engine.url, messages, 3)
    assert response.usage is not None and response.usage.input_tokens == reply["usage"]["prompt_tokens"]
    assert response.output_text == reply["choices"][0]["message"]["content"]


async def test_an_unknown_previous_response_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model=MODEL, input="go on", previous_response_id="resp_gone")
    assert caught.value.body == {
        "message": "Response with id 'resp_gone' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }


async def test_a_response_that_ran_with_its_request_cannot_be_cancelled(
    engine: SimProcess, client: openai.AsyncOpenAI
) -> None:
    done = await client.responses.create(model=MODEL, input="finished", max_output_tokens=2)
    status, body = await post(engine.url + f"/v1/responses/{done.id}/cancel", {})
    assert (status, body) == (
        400,
        {
            "error": {
                "message": "Cannot cancel a synchronous response.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 400,
            }
        },
    )
    status, body = await post(engine.url + "/v1/responses/resp_unknown/cancel", {})
    assert status == 404 and body["error"]["message"] == "Response with id 'resp_unknown' not found."
    assert (await client.responses.retrieve(done.id)).model_dump() == done.model_dump()  # unchanged


async def test_a_background_response_runs_apart_and_a_cancel_stops_it(
    engine: SimProcess, client: openai.AsyncOpenAI
) -> None:
    queued = await client.responses.create(
        model=MODEL,
        input="in the background",
        max_output_tokens=30,
        background=True,
        extra_body={"ignore_eos": True},
    )
    assert queued.status == "queued" and queued.output == [] and queued.usage is None and queued.background
    deadline = time.monotonic() + 10
    got = queued
    while got.status == "queued" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        got = await client.responses.retrieve(queued.id)
    foreground = await client.responses.create(
        model=MODEL, input="in the background", max_output_tokens=30, extra_body={"ignore_eos": True}
    )
    assert got.status == "incomplete" and got.output_text == foreground.output_text
    assert got.usage is not None and got.usage.output_tokens == 30
    # one that never progresses: the cancel ends it and its engine request
    hung = await client.responses.create(
        model=MODEL, input="stuck", background=True, extra_headers={"X-Sim-Fault": "hang"}
    )
    await wait_for(engine.url, "vllm:num_requests_waiting", 1)
    cancelled = await client.responses.cancel(hung.id)
    assert cancelled.status == "cancelled" and cancelled.id == hung.id
    assert (await client.responses.retrieve(hung.id)).status == "cancelled"
    await wait_for(engine.url, "vllm:num_requests_waiting", 0)
    status, body = await post(engine.url + f"/v1/responses/{hung.id}/cancel", {})
    assert status == 400 and body["error"]["message"] == "Cannot cancel a synchronous response."


async def test_a_background_stream_is_replayed_from_a_sequence_number(engine: SimProcess) -> None:
    body = {
        "input": "replay me",
        "max_output_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "background": True,
    }
    raw, _ = await raw_sse(engine.url + "/v1/responses", body)
    events = parse_sse(raw)
    assert [name for name, _ in events] == [*OPENING, *["response.output_text.delta"] * 5, *CLOSING]
    response_id = orjson.loads(events[0][1])["response"]["id"]
    async with aiohttp.ClientSession() as s:
        async with s.get(engine.url + f"/v1/responses/{response_id}?stream=true&starting_after=6") as r:
            assert r.status == 200
            replay = await r.read()
        async with s.get(engine.url + f"/v1/responses/{response_id}") as r:
            stored = await r.json()
    assert parse_sse(replay) == events[7:]
    assert stored == orjson.loads(events[-1][1])["response"]


async def test_without_the_store_nothing_is_kept_and_background_is_refused(store_off: SimProcess) -> None:
    async with openai.AsyncOpenAI(base_url=store_off.url + "/v1", api_key="none", max_retries=0) as client:
        made = await client.responses.create(model=MODEL, input="forget me", max_output_tokens=2, store=True)
        assert made.status in ("completed", "incomplete")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="more", previous_response_id=made.id)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="later", background=True)
    assert caught.value.body == {
        "message": "This vLLM engine does not support `store=True` and therefore does not support the "
        "background mode. To enable these features, set the environment variable "
        "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
        "type": "invalid_request_error",
        "param": "background",
        "code": 400,
    }


def test_the_store_is_an_lru_that_keeps_a_cancel() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(StoredResponse(name, {"status": "completed"}, []))
    assert store.get("a") is not None  # refreshed: "b" is now the oldest
    store.put(StoredResponse("c", {"status": "completed"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    cancelled = StoredResponse("c", {"status": "cancelled"}, [])
    store.put(cancelled)
    store.finish(StoredResponse("c", {}, []), {"status": "completed"})
    assert store.get("c") is cancelled and cancelled.body == {"status": "cancelled"}
    off = ResponseStore(0)
    off.put(StoredResponse("x", {}, []))
    assert not off.enabled and off.get("x") is None


def test_the_store_size_flag() -> None:
    assert build_parser().parse_args([]).responses_store_size == 4096
    assert build_parser().parse_args(["--responses-store-size", "0"]).responses_store_size == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--responses-store-size", "-1"])


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (
            {"input": "x", "temperature": "hot"},
            400,
            {
                "message": "1 validation error:\n  {'type': 'float_type', 'loc': 'body.temperature', "
                "'msg': 'Input should be a valid number', 'input': 'hot'}",
                "type": "Bad Request",
                "param": "body.temperature",
            },
        ),
        ({}, 400, {"type": "Bad Request", "param": "body.input"}),
        ({"input": [{"type": "bogus"}]}, 400, {"type": "Bad Request", "param": "body.input"}),
        (
            {"input": [{"role": "wizard", "content": "x"}]},
            400,
            {"type": "Bad Request", "param": "body.input"},
        ),
        ({"input": "x", "truncation": "some"}, 400, {"type": "Bad Request", "param": "body.truncation"}),
        (
            {"input": "x", "presence_penalty": 3},
            400,
            {"type": "Bad Request", "param": "body.presence_penalty"},
        ),
        (
            {"input": "x", "max_output_tokens": 0},
            400,
            {
                "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                "type": "BadRequestError",
                "param": "max_tokens",
            },
        ),
        (
            {"input": "x", "temperature": 3},
            400,
            {
                "message": "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)",
                "type": "BadRequestError",
                "param": "temperature",
            },
        ),
        (
            {"input": "x", "max_output_tokens": 40000},
            400,
            {
                "message": "max_output_tokens=40000 cannot be greater than max_model_len=32768. Please "
                "request fewer output tokens. (parameter=max_output_tokens, value=40000)",
                "param": "max_output_tokens",
            },
        ),
        (
            {"input": "x", "background": True, "store": False},
            400,
            {"message": "background can only be used when `store` is true (parameter=background)"},
        ),
        (
            {"input": "x", "tool_choice": "required"},
            400,
            {
                "message": "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)"
            },
        ),
        (
            {"input": [{"type": "item_reference", "id": "i"}]},
            400,
            {"message": "Unsupported input item type: item_reference (parameter=input)", "param": "input"},
        ),
        ({"input": "x", "model": "elsewhere"}, 404, {"message": "The model `elsewhere` does not exist."}),
        ({"input": "x " * 40000}, 400, {"param": "input_tokens", "type": "BadRequestError"}),
        ({"input": "x", "priority": 1}, 400, {"param": "priority"}),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, {"param": "tools"}),
    ],
)
async def test_what_vllm_refuses_is_refused_its_way(
    engine: SimProcess, body: dict[str, Any], status: int, error: dict[str, Any]
) -> None:
    got_status, got = await post(engine.url + "/v1/responses", body)
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["code"] == status
    assert {k: got["error"][k] for k in error} == error


async def test_sdk_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="x", temperature=5)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="no-such-model", input="x")


# -- faults, metrics ----------------------------------------------------------------------------


async def test_a_stream_that_hangs_shows_its_opening_and_its_abort_frees_it(engine: SimProcess) -> None:
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            engine.url + "/v1/responses",
            json={"input": "hang here", "stream": True},
            headers={"X-Sim-Fault": "hang"},
        )
        assert (await resp.content.readline()) == b"event: response.created\n"
        await resp.content.readline()
        await resp.content.readline()
        assert (await resp.content.readline()) == b"event: response.in_progress\n"
        await resp.content.readline()
        await resp.content.readline()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(resp.content.readline(), 0.3)
        assert await metric(engine.url, "vllm:num_requests_waiting") == 1
        resp.close()
    await wait_for(engine.url, "vllm:num_requests_waiting", 0)


async def test_a_responses_stream_counts_in_the_engine_as_a_chat_does(engine: SimProcess) -> None:
    tokens = await metric(engine.url, "vllm:generation_tokens_total")
    ttfts = await metric(engine.url, "vllm:time_to_first_token_seconds_count")
    itls = await metric(engine.url, "vllm:inter_token_latency_seconds_count")
    successes = await metric(engine.url, "vllm:request_success_total", finished_reason="length")
    raw, _ = await raw_sse(
        engine.url + "/v1/responses",
        {"input": "count me", "max_output_tokens": 12, "ignore_eos": True, "stream": True},
    )
    assert orjson.loads(parse_sse(raw)[-1][1])["response"]["usage"]["output_tokens"] == 12
    assert await metric(engine.url, "vllm:generation_tokens_total") == tokens + 12
    assert await metric(engine.url, "vllm:time_to_first_token_seconds_count") == ttfts + 1
    assert await metric(engine.url, "vllm:inter_token_latency_seconds_count") > itls
    assert await metric(engine.url, "vllm:request_success_total", finished_reason="length") == successes + 1
    assert await metric(engine.url, "vllm:num_requests_running") == 0


async def test_a_crash_mid_stream_cuts_the_connection() -> None:
    with start_sim_engine("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "20") as fresh:
        seen: list[bytes] = []
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                fresh.url + "/v1/responses",
                json={"input": "crash soon", "max_output_tokens": 50, "ignore_eos": True, "stream": True},
                headers={"X-Sim-Fault": "crash-after=3"},
            )
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                async for line in resp.content:
                    if line.startswith(b"event: "):
                        seen.append(line[7:].strip())
        assert seen[:2] == [b"response.created", b"response.in_progress"]
        assert b"response.completed" not in seen and b"response.output_text.done" not in seen
        status, body = await post(fresh.url + "/v1/responses", {"input": "again"})
        assert status == 503 and body["error"]["message"] == "engine is dead"
