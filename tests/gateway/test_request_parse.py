"""Request validation: only what routing needs, clear 400s, and nothing but GatewayError escapes."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.errors import GatewayError
from gateway.api.request_parse import parse_request

MSG = [{"role": "user", "content": "hello there"}]


def body(**kw: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": MSG, **kw})


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[]", None),
        (orjson.dumps({"messages": MSG}), "model"),
        (orjson.dumps({"model": "m"}), "messages"),
        (orjson.dumps({"model": "m", "messages": []}), "messages"),
        (orjson.dumps({"model": "m", "messages": ["hi"]}), "messages[0]"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_tokens="5"), "max_tokens"),
        (body(max_completion_tokens=True), "max_completion_tokens"),
        (body(stream="yes"), "stream"),
        (body(stream_options={"include_usage": True}), "stream_options"),
        (body(priority=1.5), "priority"),
    ],
)
def test_bad_chat_requests_are_400_with_param(raw: bytes, param: str | None) -> None:
    with pytest.raises(GatewayError) as info:
        parse_request("chat", raw, 100)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.payload()["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_chat_fields() -> None:
    parsed = parse_request("chat", body(stream=True, max_completion_tokens=7, max_tokens=99, priority=2), 100)
    assert (parsed.model, parsed.stream, parsed.max_tokens, parsed.priority) == ("m", True, 7, 2)
    assert parsed.client_wants_usage is False and parsed.prompt_tokens > 4
    assert parse_request("chat", body(), 100).max_tokens == 100


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_forms(prompt: object) -> None:
    parsed = parse_request("completions", orjson.dumps({"model": "m", "prompt": prompt}), 16)
    assert parsed.prompt_tokens >= 1


def test_token_id_prompt_counts_exactly() -> None:
    assert (
        parse_request("completions", orjson.dumps({"model": "m", "prompt": list(range(50))}), 1).prompt_tokens
        == 50
    )


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], {"x": 1}])
def test_bad_completion_prompts(prompt: object) -> None:
    with pytest.raises(GatewayError) as info:
        parse_request("completions", orjson.dumps({"model": "m", "prompt": prompt}), 16)
    assert info.value.param == "prompt"


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["model", "messages", "prompt", "stream", "max_tokens", "stream_options", "priority", "x"]
        ),
        json_values,
    ),
    st.sampled_from(["chat", "completions", "embeddings"]),
)
def test_any_json_either_parses_or_is_a_clean_400(data: dict[str, object], kind: str) -> None:
    try:
        parsed = parse_request(kind, orjson.dumps(data), 10)  # type: ignore[arg-type]
    except GatewayError as error:
        assert error.status == 400
    else:
        assert isinstance(parsed.model, str) and parsed.max_tokens >= 0 and parsed.prompt_tokens >= 0
