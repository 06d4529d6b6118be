"""Request validation over HTTP: what vLLM refuses with a 400, the sim refuses too; valid shapes pass."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.test_http_api import post
from tests.support.sim_process import SimProcess

USER = [{"role": "user", "content": "hi"}]

# (route, body, param named in the error)
REJECTED: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"messages": USER, "temperature": "hot"}, "temperature"),
    ("chat", {"messages": USER, "temperature": -0.5}, "temperature"),
    ("chat", {"messages": USER, "temperature": 2.5}, "temperature"),
    ("chat", {"messages": USER, "temperature": True}, "temperature"),
    ("chat", {"messages": USER, "top_p": 0}, "top_p"),
    ("chat", {"messages": USER, "top_p": 1.5}, "top_p"),
    ("chat", {"messages": USER, "presence_penalty": 3}, "presence_penalty"),
    ("chat", {"messages": USER, "frequency_penalty": "x"}, "frequency_penalty"),
    ("chat", {"messages": USER, "n": 0}, "n"),
    ("chat", {"messages": USER, "n": 1.5}, "n"),
    ("chat", {"messages": USER, "n": 2, "temperature": 0}, "n"),  # vLLM: greedy sampling needs n == 1
    ("chat", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": USER, "max_tokens": "10"}, "max_tokens"),
    ("chat", {"messages": USER, "max_completion_tokens": 2.5}, "max_completion_tokens"),
    ("chat", {"messages": USER, "stop": 5}, "stop"),
    ("chat", {"messages": USER, "stop": ["ok", 3]}, "stop"),
    ("chat", {"messages": USER, "stop": [""]}, "stop"),
    ("chat", {"messages": USER, "stop": ""}, "stop"),
    ("chat", {"messages": USER, "seed": "42"}, "seed"),
    ("chat", {"messages": USER, "seed": 2**64}, "seed"),
    ("chat", {"messages": USER, "logprobs": 1}, "logprobs"),
    ("chat", {"messages": USER, "stream": "yes"}, "stream"),
    ("chat", {"messages": USER, "model": 7}, "model"),
    ("chat", {}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": ["hi"]}]}, "messages"),
    ("completion", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completion", {"prompt": "x", "n": -1}, "n"),
    ("completion", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("completion", {"prompt": "x", "echo": "no"}, "echo"),
    ("completion", {"temperature": 1}, "prompt"),
    ("completion", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("completion", {"prompt": "x", "logprobs": 100}, "logprobs"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": "x", "logprobs": 2}, "logprobs"),  # (produced by vLLM, not by the sim)
    ("completion", {"prompt": "x", "logprobs": 0}, "logprobs"),
    ("chat", {"messages": USER, "logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("completion", {"prompt": "x", "echo": True}, "echo"),
    ("completion", {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),  # (past the whole context)
    ("chat", {"messages": USER, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ("completion", {"prompt": ["x"] * 1025}, "prompt"),  # (vLLM's VLLM_MAX_COMPLETION_PROMPTS)
    ("completion", {"prompt": [""]}, "prompt"),
    ("completion", {"prompt": [10**15]}, "prompt"),
    ("completion", {"prompt": [-3, 4]}, "prompt"),
    ("completion", {"prompt": "x", "min_tokens": 10, "max_tokens": 3}, "min_tokens"),
    ("chat", {"messages": USER, "min_tokens": 10, "max_tokens": 3}, "min_tokens"),
    ("chat", {"messages": USER, "top_logprobs": 5}, "top_logprobs"),
    ("chat", {"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"messages": USER, "logit_bias": "junk"}, "logit_bias"),
    ("chat", {"messages": USER, "logit_bias": {"word": 1.0}}, "logit_bias"),
    ("chat", {"messages": USER, "logit_bias": {"-5": 1.0}}, "logit_bias"),  # (out of the vocabulary)
    ("chat", {"messages": USER, "logit_bias": {"10000000": 1.0}}, "logit_bias"),
    ("chat", {"messages": USER, "logit_bias": {"50": "up"}}, "logit_bias"),
    ("chat", {"messages": USER, "response_format": 5}, "response_format"),
    ("chat", {"messages": USER, "response_format": {"type": "yaml"}}, "response_format"),
    ("chat", {"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
    (
        "chat",
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format",
    ),
    ("chat", {"messages": USER, "tools": {"type": "function"}}, "tools"),
    ("chat", {"messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools"),
    ("chat", {"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"messages": USER, "tool_choice": "auto"}, "tool_choice"),  # (vLLM: tools must be set)
    (
        "chat",
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    (
        "chat",
        {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options",
    ),
    ("chat", {"messages": USER, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("completion", {"prompt": "x", "truncate_prompt_tokens": 10**9}, "truncate_prompt_tokens"),
]

ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": USER, "temperature": 0, "top_p": 1, "n": 1, "seed": -3, "logprobs": False}),
    ("chat", {"messages": USER, "temperature": 1.3, "n": 2, "stop": ["zz"], "presence_penalty": -2}),
    ("chat", {"messages": USER, "temperature": None, "top_p": None, "stop": None, "n": None}),
    (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "t1"},
                {"role": "developer", "content": ""},
            ]
        },
    ),
    ("completion", {"prompt": "x", "echo": False, "stop": "zz", "frequency_penalty": 0.5}),
    ("chat", {"messages": USER, "top_logprobs": 0}),  # (vLLM refuses -1 and above 0 without logprobs)
    (
        "chat",
        {
            "messages": USER,
            "logit_bias": {"50": 10, "7": -100.0},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "stream_options": None,
        },
    ),
    ("chat", {"messages": USER, "response_format": {"type": "json_object"}, "tool_choice": "none"}),
    # vLLM 0.32 has no best_of (an unknown field, ignored); a type defaults to "function"; a
    # "+5" id is what int() reads
    ("completion", {"prompt": "x", "best_of": 0, "logit_bias": {"+5": 200}}),
    (
        "chat",
        {
            "messages": USER,
            "tools": [{"function": {"name": "f"}}],
            "tool_choice": {"function": {"name": "f"}},
        },
    ),
]

ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@pytest.mark.parametrize(("route", "body", "param"), REJECTED)
async def test_vllm_rejects_and_so_does_the_sim(
    engine: SimProcess, route: str, body: dict[str, Any], param: str
) -> None:
    status, answer = await post(engine.url + ROUTES[route], {"max_tokens": 2, **body})
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["code"] == 400
    assert answer["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(("route", "body"), ACCEPTED)
async def test_valid_requests_still_pass(engine: SimProcess, route: str, body: dict[str, Any]) -> None:
    status, answer = await post(engine.url + ROUTES[route], {"max_tokens": 2, **body})
    assert status == 200, answer


@pytest.mark.parametrize(
    "fault",
    ["slow=abc", "slow=0", "slow=-2", "slow=nan", "slow=inf", "crash-after=x", "crash-after=-1", "boom"],
)
async def test_a_bad_fault_header_is_a_400_not_a_500(engine: SimProcess, fault: str) -> None:
    status, answer = await post(
        engine.url + ROUTES["chat"], {"max_tokens": 2, "messages": USER}, headers={"X-Sim-Fault": fault}
    )
    assert status == 400, answer
    assert "X-Sim-Fault" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/sim/fault", b"{not json"),
        ("/sim/fault", b'{"mode": "slow", "factor": "inf"}'),  # (it slept the engine's driver for good)
        ("/sim/fault", b'{"mode": "slow", "factor": 1e999}'),
        ("/tokenize", b'{"messages": [{"role": "user", "content": 5}]}'),  # (the chat route's 400s)
        ("/tokenize", b'{"messages": [{}]}'),
        ("/sim/kv/pull", b"{not json"),
        ("/sim/kv/pull", b'{"room": 1, "wait_s": "x"}'),
        ("/sim/kv/pull", b'{"room": 1, "wait_s": -1}'),
        ("/tokenize", b'{"messages": [1]}'),
        ("/detokenize", b'{"tokens": [-1]}'),
        ("/detokenize", b'{"tokens": [10000000000]}'),
        ("/detokenize", b'{"tokens": [true]}'),
    ],
)
async def test_the_side_routes_answer_bad_input_with_a_400(engine: SimProcess, path: str, raw: bytes) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(engine.url + path, data=raw) as r:
        status, answer = r.status, await r.json(content_type=None)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}


async def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(engine: SimProcess) -> None:
    # as vLLM: the last k tokens are prefilled (usage counts them); -1 is the model's own limit
    long = [{"role": "user", "content": "a prompt of many words " * 20}]
    status, whole = await post(engine.url + ROUTES["chat"], {"max_tokens": 2, "messages": long})
    assert status == 200 and whole["usage"]["prompt_tokens"] > 10
    for keep, expected in ((7, 7), (-1, whole["usage"]["prompt_tokens"])):
        body = {"max_tokens": 2, "messages": long, "truncate_prompt_tokens": keep}
        status, answer = await post(engine.url + ROUTES["chat"], body)
        assert status == 200 and answer["usage"]["prompt_tokens"] == expected, answer
    body = {"max_tokens": 2, "prompt": list(range(1, 40)), "truncate_prompt_tokens": 5}
    status, answer = await post(engine.url + ROUTES["completion"], body)
    assert status == 200 and answer["usage"]["prompt_tokens"] == 5, answer


async def test_tools_and_tool_calls_are_part_of_the_prompt(engine: SimProcess) -> None:
    """As vLLM's chat templates write them: the tools a request lists and an assistant turn's
    calls are prompt tokens (prefilled, in usage and in /tokenize); the gateway counts them too."""
    from gateway.tokenizer import apply_chat_template, encode

    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing"}}
        for i in range(8)
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "tool_1", "arguments": "{}"}}
    messages = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "ok"},
    ]
    status, plain = await post(engine.url + ROUTES["chat"], {"max_tokens": 2, "messages": messages})
    assert status == 200, plain
    status, listed = await post(
        engine.url + ROUTES["chat"], {"max_tokens": 2, "messages": messages, "tools": tools}
    )
    assert status == 200, listed
    expected = len(encode(apply_chat_template(messages, tools=tools)))
    assert listed["usage"]["prompt_tokens"] == expected > plain["usage"]["prompt_tokens"] + 8 * 5
    assert plain["usage"]["prompt_tokens"] > len(encode(apply_chat_template(USER)))  # (the call)
    status, counted = await post(engine.url + "/tokenize", {"messages": messages, "tools": tools})
    assert status == 200 and counted["count"] == expected
