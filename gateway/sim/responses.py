"""Per-request output of the simulated engine: stop strings, SSE chunks and final bodies as vLLM.

:class:`OutputState` turns generated token ids into text deltas, holding back the last
``len(longest stop) - 1`` characters while streaming so a stop string is never partly sent.
:class:`ResponseFormat` renders vLLM 0.33's chat and completion shapes; the constant prefix of
every streamed chunk is built once per request so each token costs one small orjson call.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.tokenizer import EOS_ID, token_text


@dataclass(slots=True)
class OutputState:
    stops: tuple[str, ...] = ()
    text: str = ""
    sent: int = 0  # characters of ``text`` already handed out
    token_ids: list[int] = field(default_factory=list)
    stopped: bool = False
    #: the stop string that ended the output (vLLM's ``stop_reason``), None otherwise
    stop_reason: str | None = None

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def add(self, token: int) -> bool:
        """Append a token; True when a stop string ended the output (the text is cut before it)."""
        if token == EOS_ID:
            return False
        self.token_ids.append(token)
        if not self.stops:
            self.text += token_text(token)
            return False
        start = max(0, len(self.text) - self.holdback)
        self.text += token_text(token)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, self.stop_reason = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:at]
            self.stopped = True
        return self.stopped

    def delta(self, final: bool) -> str:
        """New text that can be sent now (everything on the final call)."""
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.holdback)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


def batch_deltas(
    out: OutputState, tokens: list[int], finished: bool
) -> Iterator[tuple[str, list[int], bool]]:
    """Per token of a batch the engine produced, added to ``out``: the text that may go out with
    it, the token ids it shows, and whether a stop string ended the output there (nothing after
    that token is read). ``finished``: the engine ended the request with this batch, so the text
    held back for stop strings goes with its last token, not its first (the later tokens may
    complete a stop string, whose start was then sent)."""
    final_k = len(tokens) - 1
    for k, token in enumerate(tokens):
        stopped = out.add(token)
        text = out.delta(stopped or (finished and k == final_k))
        yield text, [token] if out.token_ids and out.token_ids[-1] == token else [], stopped
        if stopped:
            return


class ResponseFormat:
    """Body and chunk builders for one request (``chat`` or ``completion``)."""

    def __init__(self, kind: str, request_id: str, model: str, return_token_ids: bool) -> None:
        self.kind = kind
        self.created = int(time.time())
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.return_token_ids = return_token_ids
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.index = 0
        self._head = orjson.dumps(
            {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        )
        self._chunk_head = b"data: " + self._head[:-1] + b',"choices":[{"index":0,'

    def for_choice(self, index: int) -> ResponseFormat:
        """These builders for choice ``index`` of an n > 1 request (a streamed chunk carries one
        choice); a copy, so the n = 1 path keeps its constant prefix and pays nothing."""
        other = copy.copy(self)
        other.index = index
        other._chunk_head = b"data: " + self._head[:-1] + b',"choices":[{"index":%d,' % index
        return other

    def chunk(
        self,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str | None,
        first: bool = False,
        prompt_token_ids: Sequence[int] | None = None,
        usage: dict[str, Any] | None = None,
    ) -> bytes:
        """One choice's chunk; ``usage``: the counts so far, on every chunk of a stream asking
        for them (``stream_options.continuous_usage_stats``, as vLLM writes them)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            body: dict[str, Any] = {"delta": delta}
        else:
            body = {"text": text}
        body["logprobs"] = None
        body["finish_reason"] = finish_reason
        if self.return_token_ids:
            body["token_ids"] = list(token_ids)
            if prompt_token_ids is not None and self.kind == "completion":
                body["prompt_token_ids"] = list(prompt_token_ids)
        tail = b"]"
        if self.return_token_ids and prompt_token_ids is not None and self.kind == "chat":
            tail += b',"prompt_token_ids":' + orjson.dumps(list(prompt_token_ids))
        if usage is not None:
            tail += b',"usage":' + orjson.dumps(usage)
        return self._chunk_head + orjson.dumps(body)[1:] + tail + b"}\n\n"

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return (
            b"data: "
            + orjson.dumps(
                {
                    "id": self.id,
                    "object": obj,
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage,
                }
            )
            + b"\n\n"
        )

    def final_chunk_with_params(
        self, finish_reason: str, kv_transfer_params: dict[str, Any] | None, stop_reason: str | None = None
    ) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choice: dict[str, Any] = {
            "index": self.index,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def full(
        self,
        outputs: Sequence[tuple[str, Sequence[int], str, str | None]],
        usage: dict[str, Any],
        prompts: Sequence[Sequence[int]],
        kv_transfer_params: dict[str, Any] | None,
    ) -> bytes:
        """The non-streamed body; ``outputs`` holds (text, token ids, finish_reason, stop_reason)
        per choice, ``prompts`` each choice's prompt token ids (a completions batch has several)."""
        choices: list[dict[str, Any]] = []
        for index, (text, token_ids, finish_reason, stop_reason) in enumerate(outputs):
            choice: dict[str, Any]
            if self.kind == "chat":
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": index, "text": text}
            choice.update({"logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason})
            if self.return_token_ids:
                choice["token_ids"] = list(token_ids)
                if self.kind == "completion":
                    choice["prompt_token_ids"] = list(prompts[index])
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }
        if self.return_token_ids and self.kind == "chat":
            body["prompt_token_ids"] = list(prompts[0])
        body["kv_transfer_params"] = kv_transfer_params
        return orjson.dumps(body)


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class BadRequest(Exception):
    """A request the engine answers with an error body instead of running it.

    ``kind``: the error's ``type`` when vLLM names it otherwise than by its status (its request
    models' "Bad Request", the Responses API's "invalid_request_error")."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> bytes:
    kinds = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": kind or kinds.get(status, "InternalServerError"),
                "param": param,
                "code": status,
            }
        }
    )
