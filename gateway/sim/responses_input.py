"""A Responses API request as the simulated engine takes it: checked as vLLM 0.33 checks it, and
turned into the chat messages its prompt is rendered from.

vLLM refuses a request at three layers, each with its own error shape, and so does the sim:

* its request model (pydantic): a field of the wrong type, a value outside a ``Literal`` or a
  ``Field`` bound, an input item of no known shape. 400 with ``type: "Bad Request"``, ``param``
  the field's location (``body.temperature``) and pydantic's words (``1 validation error:`` and the
  error as a dict). vLLM lists every branch of a union that failed (hundreds for one bad input
  item); the sim names one.
* its model validators and the Responses server (``background`` without ``store``, ``prompt``,
  ``tool_choice`` without tools, an input item it cannot turn into a chat message): 400
  ``BadRequestError`` whose message ends in ``(parameter=...)`` as vLLM's ``VLLMValidationError``
  prints itself.
* ``SamplingParams`` (``temperature`` in [0, 2], ``top_p`` in (0, 1], ``max_tokens`` >= 1, ...):
  the same, with vLLM's wording; checked after the prompt is rendered, as vLLM builds them then.

As everywhere in the sim, JSON ``null`` counts as absent and numeric strings are not numbers
(pydantic's lax mode would coerce them). What the sim cannot produce it refuses with a 400 naming
the field: tools, log-probabilities, image and file inputs, KV transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gateway.responses_messages import UNSUPPORTED_ITEMS
from gateway.sim.responses import BadRequest
from gateway.sim.validation import logit_bias

SCHEMA_ERROR = "Bad Request"  # vLLM's type for what its request models refuse
INT64 = (-(2**63), 2**63 - 1)

_KINDS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "str": (lambda v: isinstance(v, str), "string_type", "Input should be a valid string"),
    "int": (
        lambda v: isinstance(v, int) and not isinstance(v, bool),
        "int_type",
        "Input should be a valid integer",
    ),
    "float": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "float_type",
        "Input should be a valid number",
    ),
    "bool": (lambda v: isinstance(v, bool), "bool_type", "Input should be a valid boolean"),
    "dict": (lambda v: isinstance(v, dict), "dict_type", "Input should be a valid dictionary"),
    "list": (lambda v: isinstance(v, list), "list_type", "Input should be a valid list"),
}

#: ResponsesRequest's fields in its order (``input`` is checked apart), with their JSON kinds
_FIELDS: dict[str, str] = {
    "background": "bool",
    "include": "list",
    "instructions": "str",
    "max_output_tokens": "int",
    "max_tool_calls": "int",
    "metadata": "dict",
    "model": "str",
    "logit_bias": "dict",
    "parallel_tool_calls": "bool",
    "previous_response_id": "str",
    "reasoning": "dict",
    "include_reasoning": "bool",
    "service_tier": "str",
    "store": "bool",
    "stream": "bool",
    "temperature": "float",
    "text": "dict",
    "tools": "list",
    "top_logprobs": "int",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "truncation": "str",
    "user": "str",
    "skip_special_tokens": "bool",
    "include_stop_str_in_output": "bool",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "prompt_cache_key": "str",
    "request_id": "str",
    "session_id": "str",
    "priority": "int",
    "cache_salt": "str",
    "repetition_penalty": "float",
    "seed": "int",
    "stop_token_ids": "list",
    "ignore_eos": "bool",
    "kv_transfer_params": "dict",
    "chat_template_kwargs": "dict",
}
_LITERALS: dict[str, tuple[str, ...]] = {
    "service_tier": ("auto", "default", "flex", "scale", "priority"),
    "truncation": ("auto", "disabled"),
}
_INCLUDES = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
)
#: pydantic ``Field`` bounds of the request model: (ge, le)
_BOUNDS: dict[str, tuple[float, float]] = {
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "priority": INT64,
    "seed": INT64,
}
ROLES = ("user", "assistant", "system", "developer")
TOOL_CHOICES = ("none", "auto", "required")
_PART_TYPES = ("input_text", "input_image", "input_file")


def _shown(value: Any) -> str:
    """A rejected value as vLLM's validation handler shows it (containers described, not written)."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def schema_error(
    loc: str, code: str, msg: str, value: Any, param: str | None = None, ctx: dict[str, Any] | None = None
) -> BadRequest:
    """What vLLM answers for a request its pydantic model refuses (one error of it)."""
    error: dict[str, Any] = {"type": code, "loc": loc, "msg": msg, "input": _shown(value)}
    if ctx:
        error["ctx"] = ctx
    return BadRequest(400, f"1 validation error:\n  {error}", param or loc, SCHEMA_ERROR)


def vllm_error(message: str, parameter: str | None, value: Any = None) -> BadRequest:
    """A ``VLLMValidationError``: its message carries the parameter (and value) it names."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return BadRequest(400, f"{message} ({', '.join(extras)})" if extras else message, parameter)


def _wrong_kind(loc: str, kind: str, value: Any) -> BadRequest:
    _, code, msg = _KINDS[kind]
    return schema_error(loc, code, msg, value)


def _expected(options: tuple[str, ...]) -> str:
    quoted = [f"'{o}'" for o in options]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _literal(loc: str, value: Any, options: tuple[str, ...], param: str | None = None) -> BadRequest:
    expected = _expected(options)
    msg = f"Input should be {expected}"
    return schema_error(loc, "literal_error", msg, value, param, {"expected": expected})


def check_body(body: Mapping[str, Any]) -> None:
    """Raise :class:`BadRequest` for what vLLM's request model refuses, and for what the sim cannot
    do; the sampling parameters' ranges are :func:`sampling`'s."""
    # the model's "before" validators run ahead of its fields, as in vLLM
    if body.get("background") and not body.get("store", True):
        raise vllm_error("background can only be used when `store` is true", "background")
    if body.get("prompt") is not None:
        raise vllm_error("prompt template is not supported", "prompt")
    _check_tool_choice(body.get("tool_choice"), body.get("tools"))
    if "input" not in body:  # (null is refused below, as not a string)
        raise schema_error("body.input", "missing", "Field required", dict(body))
    _check_input(body["input"])
    for name, kind in _FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        loc = f"body.{name}"
        if not _KINDS[kind][0](value):
            raise _wrong_kind(loc, kind, value)
        if name in _LITERALS and value not in _LITERALS[name]:
            raise _literal(loc, value, _LITERALS[name])
        if name in _BOUNDS:
            lo, hi = _BOUNDS[name]
            if value < lo:
                msg = f"Input should be greater than or equal to {lo:g}"
                raise schema_error(loc, "greater_than_equal", msg, value, ctx={"ge": lo})
            if value > hi:
                msg = f"Input should be less than or equal to {hi:g}"
                raise schema_error(loc, "less_than_equal", msg, value, ctx={"le": hi})
    _check_members(body)
    _refuse_unsupported(body)


def _check_tool_choice(choice: Any, tools: Any) -> None:
    if isinstance(tools, list) and tools:
        return  # (tools are refused later, by the sim)
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required":
        raise vllm_error("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        raise vllm_error("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    raise _literal("body.tool_choice", choice, TOOL_CHOICES)


def _check_members(body: Mapping[str, Any]) -> None:
    """The insides of the container fields the sim reads or repeats."""
    for key, value in (body.get("metadata") or {}).items():
        if not isinstance(value, str):
            raise _wrong_kind(f"body.metadata.{key}", "str", value)
    for i, entry in enumerate(body.get("include") or ()):
        if entry not in _INCLUDES:
            raise _literal(f"body.include.{i}", entry, _INCLUDES)
    for i, token in enumerate(body.get("stop_token_ids") or ()):
        if not _KINDS["int"][0](token):
            raise _wrong_kind(f"body.stop_token_ids.{i}", "int", token)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list):
            raise _wrong_kind("body.stop", "str", stop)
        for i, entry in enumerate(stop):
            if not isinstance(entry, str):
                raise _wrong_kind(f"body.stop.{i}", "str", entry)
    salt = body.get("cache_salt")
    if salt == "":
        msg = "String should have at least 1 character"
        raise schema_error("body.cache_salt", "string_too_short", msg, salt, ctx={"min_length": 1})
    if salt is not None and len(salt) > 1024:
        msg = "String should have at most 1024 characters"
        raise schema_error("body.cache_salt", "string_too_long", msg, salt, ctx={"max_length": 1024})
    bias = body.get("logit_bias")
    if bias is not None and (problem := logit_bias("logit_bias", bias)) is not None:
        raise BadRequest(400, problem, "logit_bias")


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("tools"):
        raise BadRequest(400, "the simulated engine does not call tools (vLLM does)", "tools")
    if "message.output_text.logprobs" in (body.get("include") or ()):
        raise BadRequest(400, "the simulated engine produces no log-probabilities (vLLM does)", "include")
    if body.get("kv_transfer_params") is not None:
        raise BadRequest(
            400, "the simulated engine takes no KV transfer (P/D) on the Responses API", "kv_transfer_params"
        )


def _check_input(value: Any) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        first = {"type": "string_type", "loc": "body.input", "msg": _KINDS["str"][2], "input": _shown(value)}
        second = {"type": "list_type", "loc": "body.input", "msg": _KINDS["list"][2], "input": _shown(value)}
        message = f"2 validation errors:\n  {first}\n  {second}"
        raise BadRequest(400, message, "body.input", SCHEMA_ERROR)
    for i, item in enumerate(value):
        _check_item(f"body.input.{i}", item)


def _check_item(loc: str, item: Any) -> None:
    if not isinstance(item, dict):
        raise schema_error(loc, "dict_type", _KINDS["dict"][2], item, "body.input")
    kind = item.get("type")
    if kind is None or kind == "message":
        _check_message(loc, item)
    elif kind == "function_call":
        _strings(loc, item, ("call_id", "name", "arguments"))
    elif kind == "function_call_output":
        _strings(loc, item, ("call_id", "output"))
    elif kind == "reasoning":
        _check_reasoning(loc, item)
    elif kind not in UNSUPPORTED_ITEMS:
        raise _literal(f"{loc}.type", kind, ("message",), "body.input")


def _strings(loc: str, item: Mapping[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name not in item:
            raise schema_error(f"{loc}.{name}", "missing", "Field required", dict(item), "body.input")
        if not isinstance(item[name], str):
            raise schema_error(f"{loc}.{name}", "string_type", _KINDS["str"][2], item[name], "body.input")


def _check_message(loc: str, item: Mapping[str, Any]) -> None:
    role = item.get("role")
    if role not in ROLES:
        if "role" not in item:
            raise schema_error(f"{loc}.role", "missing", "Field required", dict(item), "body.input")
        raise _literal(f"{loc}.role", role, ROLES, "body.input")
    if "content" not in item:
        raise schema_error(f"{loc}.content", "missing", "Field required", dict(item), "body.input")
    content = item["content"]
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise schema_error(f"{loc}.content", "string_type", _KINDS["str"][2], content, "body.input")
    # an assistant "message" item is vLLM's output message, whose parts are output text
    types = (
        ("output_text", *_PART_TYPES)
        if role == "assistant" and item.get("type") == "message"
        else _PART_TYPES
    )
    for j, part in enumerate(content):
        where = f"{loc}.content.{j}"
        if not isinstance(part, dict):
            raise schema_error(where, "dict_type", _KINDS["dict"][2], part, "body.input")
        if part.get("type") not in types:
            raise _literal(f"{where}.type", part.get("type"), types, "body.input")
        if part["type"] in ("input_image", "input_file"):
            raise BadRequest(400, f"the simulated engine takes text only, not {part['type']} parts", "input")
        _strings(where, part, ("text",))


def _check_reasoning(loc: str, item: Mapping[str, Any]) -> None:
    if item.get("encrypted_content"):
        raise vllm_error("Encrypted content is not supported.", "input")
    if not isinstance(item.get("summary"), list):
        raise schema_error(
            f"{loc}.summary", "list_type", _KINDS["list"][2], item.get("summary"), "body.input"
        )
    for field, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        for j, part in enumerate(item.get(field) or ()):
            if not isinstance(part, dict) or part.get("type") != part_type:
                raise _literal(f"{loc}.{field}.{j}.type", part, (part_type,), "body.input")
            _strings(f"{loc}.{field}.{j}", part, ("text",))


# -- sampling parameters ---------------------------------------------------------------------------

GREEDY_EPS = 1e-5  # below it vLLM samples greedily (and resets top_p)
MIN_TEMPERATURE = 1e-2  # a lower non-zero temperature vLLM raises to this


def sampling(body: Mapping[str, Any], max_tokens: int) -> tuple[float, float]:
    """The temperature and top_p the request runs with (what its response repeats), after
    ``SamplingParams``' checks in vLLM's order and wording; ``max_tokens``: its output bound."""
    temperature = float(_given(body, "temperature", 1.0))
    top_p = float(_given(body, "top_p", 1.0))
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    penalty = body.get("repetition_penalty")
    if penalty is not None:
        if not math.isfinite(penalty):
            raise vllm_error(f"repetition_penalty must be a finite number, got {float(penalty)}.", None)
        if penalty <= 0:
            raise vllm_error(f"repetition_penalty must be greater than zero, got {float(penalty)}.", None)
    for bad, why in (
        (not math.isfinite(temperature), "be a finite number"),
        (temperature < 0, "be non-negative"),
        (temperature > 2, "be in [0, 2]"),
    ):
        if bad:
            raise vllm_error(f"temperature must {why}, got {temperature}.", "temperature", temperature)
    if not 0 < top_p <= 1:
        raise vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = body.get("top_k")
    if top_k is not None and top_k < -1:
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.", None)
    min_p = body.get("min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise vllm_error(f"min_p must be in [0, 1], got {float(min_p)}.", None)
    if max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if any(not s for s in stops(body)):
        raise vllm_error("stop cannot contain an empty string.", None)
    return temperature, 1.0 if temperature < GREEDY_EPS else top_p


def _given(body: Mapping[str, Any], name: str, default: float) -> Any:
    value = body.get(name)
    return default if value is None else value


def stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop") or ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
