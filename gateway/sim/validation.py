"""Request-body validation for the sim's generation routes, rejecting what vLLM rejects with a 400.

vLLM refuses a wrongly typed field (``"temperature": "hot"``, a message with ``"content": 5``) in its
pydantic request models and an out-of-range value (``top_p: 0``, ``n: 0``) in ``SamplingParams``;
both reach the client as a 400 with an OpenAI-shaped error body. The sim does the same from one
table per route: field name -> check, where a check returns None for an acceptable value and the
error message otherwise.

JSON ``null`` counts as absent, as for pydantic's optional fields. The sim is stricter than pydantic's
lax mode in one way: numeric strings such as ``"0.5"`` are not coerced to numbers (pydantic would
accept them); a client relying on that coercion is broken against any other OpenAI server anyway.
The sim validates sampling parameters but does not use them: its output stays deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gateway.api.errors import described
from gateway.tokenizer import VOCAB_SIZE

#: returns None when ``value`` is acceptable for field ``name``, else the error message
Check = Callable[[str, Any], str | None]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
INT64 = (-(2**63), 2**63 - 1)
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
GREEDY_EPS = 1e-5  # below this temperature vLLM samples greedily
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
COMPLETION_MAX_TOKENS = 16  # a completion's bound when its body gives none (vLLM's default)


def _show(value: Any) -> str:
    if isinstance(value, list | dict):
        return described(value)  # (repr() of one nested 1,000 deep raised: a 500)
    text = repr(value[:60] if isinstance(value, str) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(name: str, value: float, lo: float | None, hi: float | None, lo_open: bool) -> str | None:
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and value > hi
    if not below and not above:
        return None
    if lo is not None and hi is not None:
        return f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}."
    if lo is not None:
        return f"{name} must be {'greater than' if lo_open else 'at least'} {lo:g}, got {value}."
    return f"{name} must be at most {hi:g}, got {value}."


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Check:
    def check(name: str, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} must be a number, got {_show(value)}"
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value}."
        return _range(name, value, lo, hi, lo_open)

    return check


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    def check(name: str, value: Any) -> str | None:
        if not _is_int(value):
            return f"{name} must be an integer, got {_show(value)}"
        return _range(name, value, lo, hi, False)

    return check


def boolean(name: str, value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{name} must be a boolean, got {_show(value)}"


def string(name: str, value: Any) -> str | None:
    return None if isinstance(value, str) else f"{name} must be a string, got {_show(value)}"


def obj(name: str, value: Any) -> str | None:
    return None if isinstance(value, dict) else f"{name} must be an object, got {_show(value)}"


def stop(name: str, value: Any) -> str | None:
    if isinstance(value, str):
        return None if value else f"{name} cannot contain an empty string."
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return f"{name} must be a string or a list of strings, got {_show(value)}"
    if not all(value):
        return f"{name} cannot contain an empty string."
    return None


def _content_problem(where: str, role: str, content: Any) -> str | None:
    if isinstance(content, str):
        return None
    if content is None:
        # an assistant turn may carry only tool calls; every other role has something to say
        return None if role == "assistant" else f"{where} is required for role {role!r}"
    if not isinstance(content, list):
        return f"{where} must be a string, a list of content parts or null, got {_show(content)}"
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"{where}[{j}] must be an object with a string 'type', got {_show(part)}"
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return f"{where}[{j}].text must be a string, got {_show(part.get('text'))}"
    return None


def messages(name: str, value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"{name} must be a non-empty list of message objects, got {_show(value)}"
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            return f"{where} must be an object, got {_show(message)}"
        role = message.get("role")
        if role not in ROLES:
            return f"{where}.role must be one of {sorted(ROLES)}, got {_show(role)}"
        problem = _content_problem(f"{where}.content", role, message.get("content"))
        if problem is not None:
            return problem
    return None


def logit_bias(name: str, value: Any) -> str | None:
    """Token id (a JSON object's key: a string ``int()`` reads) -> bias, the id in the
    vocabulary, as vLLM's ``SamplingParams`` converts and checks them (the bias is clamped)."""
    if not isinstance(value, dict):
        return f"{name} must be an object of token ids to numbers, got {_show(value)}"
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            return f"{name} contains key(s) that cannot be converted to integer token IDs: {[key]!r}"
        if not 0 <= token < VOCAB_SIZE:
            return f"token id {token} in {name} is out of the vocabulary (size {VOCAB_SIZE})"
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            return f"{name}[{key}] must be a finite number, got {_show(bias)}"
    return None


#: vLLM 0.32's response formats (and its structural tags)
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema", "structural_tag"})


def response_format(name: str, value: Any) -> str | None:
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        return f"{name} must be an object with a 'type' of {sorted(RESPONSE_FORMATS)}, got {_show(value)}"
    if value["type"] == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            return f"{name}.json_schema must be an object with a string 'name'"
    return None


def _function(where: str, value: Any) -> str | None:
    """A tool, or a named tool choice: ``type`` is ``function`` (its default, as vLLM's models
    have it) and ``function`` names it."""
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        return f"{where} must be an object of 'type' 'function', got {_show(value)}"
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        return f"{where}.function must be an object with a non-empty string 'name', got {_show(function)}"
    return None


def tools(name: str, value: Any) -> str | None:
    if not isinstance(value, list):
        return f"{name} must be a list of tools, got {_show(value)}"
    for i, tool in enumerate(value):
        problem = _function(f"{name}[{i}]", tool)
        if problem is not None:
            return problem
    return None


TOOL_CHOICES = ("none", "auto", "required")


def tool_choice(name: str, value: Any) -> str | None:
    if isinstance(value, str):
        if value in TOOL_CHOICES:
            return None
        return f"{name} must be one of {list(TOOL_CHOICES)} or a named function, got {_show(value)}"
    return _function(name, value)


def _tool_choice_problem(body: Mapping[str, Any]) -> str | None:
    """What vLLM's chat request model says of ``tool_choice`` against ``tools`` (each already
    well formed): a choice other than ``none`` needs tools, and a named one, one of them."""
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return None
    listed = body.get("tools")
    if listed is None:
        return "When using `tool_choice`, `tools` must be set."
    if isinstance(choice, dict) and all(t["function"]["name"] != choice["function"]["name"] for t in listed):
        return "The tool specified in `tool_choice` does not match any of the specified `tools`"
    return None


def stream_options(name: str, value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"{name} must be an object, got {_show(value)}"
    for flag in ("include_usage", "continuous_usage_stats"):
        if value.get(flag) is not None and not isinstance(value[flag], bool):
            return f"{name}.{flag} must be a boolean, got {_show(value[flag])}"
    return None


_SAMPLING: dict[str, Check] = {
    "model": string,
    "n": integer(1, MAX_N),
    "temperature": number(0.0, 2.0),
    "top_p": number(0.0, 1.0, lo_open=True),
    "top_k": integer(-1),
    "min_p": number(0.0, 1.0),
    "presence_penalty": number(-2.0, 2.0),
    "frequency_penalty": number(-2.0, 2.0),
    "repetition_penalty": number(0.0, lo_open=True),
    "max_tokens": integer(1),
    "min_tokens": integer(0),
    "seed": integer(*INT64),
    "stop": stop,
    "stream": boolean,
    "stream_options": stream_options,
    "logit_bias": logit_bias,
    "response_format": response_format,
    "ignore_eos": boolean,
    "return_token_ids": boolean,
    "user": string,
    # keep only the prompt's last k tokens (-1: the model's own limit), as vLLM does
    "truncate_prompt_tokens": integer(-1),
}

FIELDS: Mapping[str, Mapping[str, Check]] = {
    "chat": {
        "messages": messages,  # first: a chat request without messages is wrong before anything else
        **_SAMPLING,
        "max_completion_tokens": integer(1),
        "logprobs": boolean,
        "top_logprobs": integer(0, MAX_LOGPROBS),
        "tools": tools,
        "tool_choice": tool_choice,
    },
    "completion": {**_SAMPLING, "logprobs": integer(0, MAX_LOGPROBS), "echo": boolean},
}
REQUIRED: Mapping[str, tuple[str, ...]] = {"chat": ("messages",), "completion": ("prompt",)}


def validate(kind: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first problem with a ``chat`` or ``completion`` body as ``(message, param)``, or None."""
    for name in REQUIRED[kind]:
        if body.get(name) is None:
            return f"{name} is required", name
    for name, check in FIELDS[kind].items():
        value = body.get(name)
        if value is not None:
            problem = check(name, value)
            if problem is not None:
                return problem, name
    n = body.get("n")
    temperature = body.get("temperature")
    if n is not None and n > 1 and temperature is not None and temperature < GREEDY_EPS:
        return f"n must be 1 when using greedy sampling, got {n}.", "n"
    if kind == "chat":
        problem = _tool_choice_problem(body)
        if problem is not None:
            return problem, "tool_choice"
    min_tokens = body.get("min_tokens")
    limit = body.get("max_completion_tokens") if kind == "chat" else None
    limit = limit if limit is not None else body.get("max_tokens")
    if limit is None and kind == "completion":
        limit = COMPLETION_MAX_TOKENS  # (vLLM's default bound, which min_tokens is held to as well)
    if min_tokens is not None and limit is not None and min_tokens > limit:
        return f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}.", "min_tokens"
    top = body.get("top_logprobs")
    if kind == "chat" and top is not None and top != 0 and not body.get("logprobs"):
        return "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
    # what it cannot produce it refuses, rather than answer without (a client reading the
    # logprobs it asked for found null; an echo's prompt was missing from the text)
    if (kind == "chat" and body.get("logprobs")) or (
        kind == "completion" and body.get("logprobs") is not None
    ):
        return "the simulated engine produces no log-probabilities (vLLM does)", "logprobs"
    if kind == "completion" and body.get("echo"):
        return "the simulated engine does not echo the prompt (vLLM does)", "echo"
    return None
