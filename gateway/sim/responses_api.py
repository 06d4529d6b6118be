"""vLLM 0.33's Responses API on the wire (its non-harmony path): response objects and SSE events.

A response object carries vLLM's fields in vLLM's order (``ResponsesResponse.from_request``: what
the request asked for, the sampling parameters it ran with, status, output and usage). A stream
is ``event: <type>\\ndata: <compact JSON>\\n\\n`` per event with ``sequence_number`` counting from 0:
``response.created``, ``response.in_progress``, then with the first text ``output_item.added`` and
``content_part.added``, an ``output_text.delta`` per step that produced text, ``output_text.done``,
``content_part.done``, ``output_item.done``, and ``response.completed`` holding the whole response
(``status: "incomplete"`` when the token limit cut it; vLLM sends no other final event and no
``[DONE]``). An event's own keys are in alphabetical order, as the openai models vLLM dumps have
them. A delta event's constant bytes are built once per response, so each token costs one small
``orjson.dumps`` of its text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import orjson

#: the parts of a request a response repeats, in the order vLLM writes them
Echo = dict[str, Any]


def new_id(prefix: str) -> str:
    """``<prefix>_`` and 16 hex digits, as vLLM's ``random_uuid`` makes ids."""
    return f"{prefix}_{os.urandom(8).hex()}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, block_size: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage`` for one engine request. ``cache_write_tokens``: the prompt's tokens
    that went into full (hashed) blocks and were not read from the cache, as vLLM's scheduler
    estimates them when the prompt is done; the per-turn lists stay empty on this path in vLLM."""
    written = max(0, prompt_tokens // block_size * block_size - cached_tokens)
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": written,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message output item; no content part when there is no text (as vLLM)."""
    return {
        "id": item_id,
        "content": [text_part(text, None)] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response_body(
    echo: Echo,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage_: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response object; ``echo`` (:func:`echo_of`) gives its request's side."""
    body: dict[str, Any] = {
        "id": echo["id"],
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"],
        "metadata": echo["metadata"],
        "model": echo["model"],
        "object": "response",
        "output": output,
    }
    for name in _ECHO_MIDDLE:
        body[name] = echo[name]
    body["status"] = status
    body["text"] = echo["text"]
    body["top_logprobs"] = None
    body["truncation"] = echo["truncation"]
    body["usage"] = usage_
    body["user"] = echo["user"]
    body["presence_penalty"] = echo["presence_penalty"]
    body["frequency_penalty"] = echo["frequency_penalty"]
    body.update(_VLLM_TAIL)
    return body


_ECHO_MIDDLE = (
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
)
#: vLLM's own fields, null on this path (no P/D, no encoder cache, enable_response_messages off)
_VLLM_TAIL = {
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "input_messages": None,
    "output_messages": None,
}


def echo_of(
    response_id: str,
    model: str,
    body: dict[str, Any],
    temperature: float,
    top_p: float,
    max_output_tokens: int,
) -> Echo:
    """What a response repeats of a (validated) request body: its own fields (null counting as
    absent, as everywhere in the sim), and the sampling parameters it ran with."""

    def given(name: str, default: Any = None) -> Any:
        value = body.get(name)
        return default if value is None else value

    return {
        "id": response_id,
        "instructions": given("instructions"),
        "metadata": given("metadata"),
        "model": model,
        "parallel_tool_calls": given("parallel_tool_calls", True),
        "temperature": temperature,
        # (without tools vLLM's request model turns "auto" into "none"; the sim takes no tools)
        "tool_choice": "none",
        "tools": [],
        "top_p": top_p,
        "background": given("background", False),
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": given("max_tool_calls"),
        "previous_response_id": given("previous_response_id"),
        "prompt": None,
        "reasoning": _fields(given("reasoning"), _REASONING_FIELDS),
        "service_tier": given("service_tier", "auto"),
        "text": _fields(given("text"), _TEXT_FIELDS),
        "truncation": given("truncation", "disabled"),
        "user": given("user"),
        "presence_penalty": float(given("presence_penalty", 0.0)),
        "frequency_penalty": float(given("frequency_penalty", 0.0)),
    }


#: the fields vLLM's models of ``reasoning`` and ``text`` write back (those not given as null)
_REASONING_FIELDS = ("context", "effort", "generate_summary", "mode", "summary")
_TEXT_FIELDS = ("format", "verbosity")


def _fields(given: Any, names: tuple[str, ...]) -> dict[str, Any] | None:
    if not isinstance(given, dict):
        return None
    return {name: given.get(name) for name in names}


def sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@dataclass(slots=True)
class EventStream:
    """The events of one streamed response, numbered as they are made."""

    echo: Echo
    created_at: int
    item_id: str
    seq: int = 0
    opened: bool = False
    #: the text sent, piece by piece (joined once, at the end)
    pieces: list[str] = field(default_factory=list)
    _delta_head: bytes = b""
    _delta_mid: bytes = b""

    @classmethod
    def start(cls, echo: Echo, created_at: int) -> EventStream:
        stream = cls(echo, created_at, new_id("msg"))
        stream._delta_head = b'event: response.output_text.delta\ndata: {"content_index":0,"delta":'
        stream._delta_mid = (
            b',"item_id":"' + stream.item_id.encode() + b'","logprobs":[],"output_index":0,"sequence_number":'
        )
        return stream

    def event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = dict(sorted({**fields, "sequence_number": self.seq, "type": kind}.items()))
        self.seq += 1
        return sse(kind, data)

    def opening(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress``, sent before the engine runs."""
        body = response_body(self.echo, self.created_at, "in_progress", [], None)
        return [
            self.event("response.created", {"response": body}),
            self.event("response.in_progress", {"response": body}),
        ]

    def delta(self, text: str) -> list[bytes]:
        """The events for a step's text (empty text makes none, as in vLLM)."""
        if not text:
            return []
        events = [] if self.opened else self._open()
        self.pieces.append(text)
        events.append(
            self._delta_head
            + orjson.dumps(text)
            + self._delta_mid
            + str(self.seq).encode()
            + b',"type":"response.output_text.delta"}\n\n'
        )
        self.seq += 1
        return events

    def _open(self) -> list[bytes]:
        self.opened = True
        item = message_item(self.item_id, "", "in_progress")
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_item.added", {"item": item, "output_index": 0}),
            self.event("response.content_part.added", {**where, "part": text_part("", [])}),
        ]

    def output(self) -> list[dict[str, Any]]:
        """The output items the stream sent (none when no text came), as the final response has them."""
        return [message_item(self.item_id, "".join(self.pieces), "completed")] if self.opened else []

    def closing(self, final: dict[str, Any]) -> list[bytes]:
        """The text's ``done`` events (if any text came), then ``response.completed`` with ``final``."""
        events: list[bytes] = []
        if self.opened:
            text = "".join(self.pieces)
            where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            events += [
                self.event("response.output_text.done", {**where, "logprobs": [], "text": text}),
                self.event("response.content_part.done", {**where, "part": text_part(text, None)}),
                self.event("response.output_item.done", {"item": self.output()[0], "output_index": 0}),
            ]
        events.append(self.event("response.completed", {"response": final}))
        return events
