"""Parse and validate only what routing needs; everything else passes through untouched.

The hot path parses the body once with orjson. Validation is limited to the fields the gateway
acts on (model, messages/prompt/input, stream, token limits, priority); anything the engine
understands and the gateway does not is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.api.errors import GatewayError, bad_request
from gateway.tokenizer import count_tokens

RouteKind = Literal["chat", "completions", "embeddings"]

#: per-message framing tokens of a ChatML-style template (role header and end marker)
_MESSAGE_OVERHEAD_TOKENS = 4


@dataclass(slots=True)
class ParsedRequest:
    kind: RouteKind
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    prompt_tokens: int
    priority: int
    forward_headers: dict[str, str] = field(default_factory=dict)


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{key}' must be an integer >= 1, got {value!r}", key)
    return value


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return count_tokens(content)
    if isinstance(content, list):
        n = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                n += count_tokens(part["text"])
        return n
    return 0


def _chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of message objects", "messages")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        total += _MESSAGE_OVERHEAD_TOKENS + _content_tokens(message.get("content"))
    return total + 1


def _completion_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return count_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(count_tokens(p) for p in prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of those",
        "prompt",
    )


def _embedding_input_tokens(body: dict[str, Any]) -> int:
    value = body.get("input")
    if isinstance(value, str):
        return count_tokens(value)
    if isinstance(value, list) and value:
        return sum(
            count_tokens(v) if isinstance(v, str) else len(v) if isinstance(v, list) else 1 for v in value
        )
    raise bad_request("'input' must be a string or a non-empty array", "input")


def parse_request(kind: RouteKind, raw: bytes, default_max_tokens: int) -> ParsedRequest:
    """Validate the routing-relevant fields of an OpenAI request body; raise a 400 on bad input."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise bad_request("'priority' must be an integer", "priority")

    if kind == "embeddings":
        return ParsedRequest(kind, raw, body, model, False, False, 0, _embedding_input_tokens(body), priority)
    prompt_tokens = _chat_prompt_tokens(body) if kind == "chat" else _completion_prompt_tokens(body)
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    wants_usage = bool(options and options.get("include_usage"))
    return ParsedRequest(
        kind,
        raw,
        body,
        model,
        stream,
        wants_usage,
        max_tokens or default_max_tokens,
        prompt_tokens,
        priority,
    )
