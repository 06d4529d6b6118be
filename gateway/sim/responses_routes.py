"""The simulated engine's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``, as vLLM 0.33 serves them for a model with an ordinary chat
template (its non-harmony path).

A request is one engine request, queued, scheduled, paced and aborted as a chat request is: its
prompt is the sim's chat rendering of the messages vLLM builds (instructions, the previous
response's conversation, the input), so ``usage.input_tokens``, prefix caching and the engine's
metrics agree with a chat request holding the same messages, and the ``X-Sim-*`` controls apply.
A crash cuts a stream at the TCP level: vLLM 0.33 sends no error event on this path either (its
attempt to send one for a failed generation fails its own event validation, and an engine death
is not caught), so its client too sees a truncated body.

With the store (:mod:`gateway.sim.responses_store`): a finished response is kept, ``GET`` returns
it, ``previous_response_id`` continues its conversation, ``background: true`` runs the request
apart from its connection (``queued`` until it ends; a cancel stops it) and a background stream
can be replayed with ``GET ...?stream=true&starting_after=N``. Without it, as vLLM without
``VLLM_ENABLE_RESPONSES_API_STORE``: ``store`` is ignored, every id is unknown (404) and
``background`` is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.responses_messages import UnsupportedItem, conversation
from gateway.sim.engine import SimRequest
from gateway.sim.responses import BadRequest, OutputState, batch_deltas, error_body
from gateway.sim.responses_api import Echo, EventStream, echo_of, message_item, new_id, response_body, usage
from gateway.sim.responses_input import (
    SCHEMA_ERROR,
    check_body,
    sampling,
    schema_error,
    stops,
    vllm_error,
)
from gateway.sim.responses_store import ResponseStore, StoredResponse
from gateway.tokenizer import apply_chat_template, encode

if TYPE_CHECKING:
    from gateway.sim.server import Channel, SimServer

_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_COMPLETED = b"event: response.completed\n"
#: the error type vLLM's Responses server gives its own refusals
INVALID_REQUEST = "invalid_request_error"
BACKGROUND_WITHOUT_STORE = (
    "This vLLM engine does not support `store=True` and therefore does not support the background "
    "mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` "
    "when launching the vLLM server."
)


@dataclass(slots=True)
class Run:
    """One Responses request inside the engine."""

    sim: SimRequest
    channel: Channel
    out: OutputState
    echo: Echo
    created_at: int
    #: where its final response is stored; None: not stored
    entry: StoredResponse | None


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _error(exc: BadRequest) -> web.Response:
    body = error_body(exc.status, str(exc), exc.param, exc.kind)
    return web.Response(status=exc.status, body=body, content_type="application/json")


def not_found(response_id: str) -> BadRequest:
    return BadRequest(404, f"Response with id '{response_id}' not found.", "response_id", INVALID_REQUEST)


class ResponsesRoutes:
    """Handlers bound to one :class:`SimServer`; the engine's state lives on the server."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.store = ResponseStore(server.config.responses_store)
        self._background: set[asyncio.Task[None]] = set()

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/responses", self.create)
        r.add_get("/v1/responses/{response_id}", self.retrieve)
        r.add_post("/v1/responses/{response_id}/cancel", self.cancel)

    async def close(self) -> None:
        """Stop the background responses still running (the engine is stopping)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # -- POST /v1/responses ----------------------------------------------------------------------

    async def create(self, http: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await http.read())
            if not isinstance(body, dict):
                msg = "Input should be a valid dictionary or object to extract fields from"
                raise schema_error("body", "model_attributes_type", msg, body)
            if self.server.crashed:
                raise BadRequest(503, "engine is dead")
            return await self._create(http, body)
        except orjson.JSONDecodeError as exc:
            return _error(BadRequest(400, f"invalid JSON: {exc}"))
        except BadRequest as exc:
            return _error(exc)
        except ConnectionAbortedError as exc:  # the engine died under a non-streamed request
            return _error(BadRequest(500, f"EngineDeadError: {exc}"))

    async def _create(self, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        # (in vLLM's order: request model, model, store and background, previous response,
        # rendering and its lengths, sampling parameters)
        check_body(body)
        model = body.get("model")
        if model is not None and not self.server.loras.serves(model):
            raise BadRequest(404, f"The model `{model}` does not exist.", "model")
        background = bool(body.get("background"))
        if background and not self.store.enabled:
            raise BadRequest(400, BACKGROUND_WITHOUT_STORE, "background", INVALID_REQUEST)
        previous: StoredResponse | None = None
        if body.get("previous_response_id") is not None:
            previous = self.store.get(body["previous_response_id"])
            if previous is None:
                raise not_found(body["previous_response_id"])
        try:
            messages = conversation(
                body,
                previous.messages if previous is not None else None,
                previous.body["output"] if previous is not None else None,
            )
        except UnsupportedItem as exc:
            raise vllm_error(str(exc), "input") from None
        prompt, max_tokens = self._prompt(messages, body.get("max_output_tokens"))
        temperature, top_p = sampling(body, max_tokens)
        priority = self.server._priority(body)
        output_len = self.server._output_len(http, body)
        given_id = body.get("request_id")
        response_id = given_id if given_id is not None else new_id("resp")
        served = model if isinstance(model, str) else self.server.config.model
        echo = echo_of(response_id, served, body, temperature, top_p, max_tokens)
        sim = SimRequest(
            f"{response_id}_0-{os.urandom(4).hex()}",
            prompt,
            max_tokens,
            self.server.now(),
            priority=priority,
            ignore_eos=bool(body.get("ignore_eos")),
            output_len=output_len,
        )
        store = self.store.enabled and bool(body.get("store", True))
        entry = StoredResponse(response_id, {}, messages) if store else None
        channel = self.server.admit(sim, http.headers.get("X-Sim-Fault"))
        run = Run(sim, channel, OutputState(stops(body)), echo, int(time.time()), entry)
        stream = bool(body.get("stream"))
        if entry is not None and background:
            return await self._start_background(http, run, entry, stream)
        try:
            if stream:
                return await self._stream(http, run)
            return _json(await self._collect(run))
        finally:
            self.server.release(sim)

    def _prompt(self, messages: list[dict[str, Any]], limit: int | None) -> tuple[list[int], int]:
        """The prompt's token ids and the output bound, refused as vLLM refuses them."""
        max_len = self.server.profile.max_model_len
        if limit is not None and limit > max_len:
            raise vllm_error(
                f"max_output_tokens={limit} cannot be greater than max_model_len={max_len}. "
                "Please request fewer output tokens.",
                "max_output_tokens",
                limit,
            )
        try:
            prompt = encode(apply_chat_template(messages))
        except ValueError as exc:  # (tool calls nested too deep to write)
            raise BadRequest(400, f"the input cannot be rendered: {exc}", "input") from None
        if len(prompt) > max_len:
            # (vLLM tokenizes at most one token past the limit, and says so)
            shown = min(len(prompt), max_len + 1)
            qualifier = "at least " if shown == max_len + 1 else ""
            raise vllm_error(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"contains {qualifier}{shown} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                shown,
            )
        if len(prompt) == max_len:
            raise BadRequest(
                400,
                f"The engine prompt length {len(prompt)} exceeds the max_model_len {max_len}. "
                "Please reduce prompt.",
                "input",
                INVALID_REQUEST,
            )
        cache = self.server.model.cache
        if cache.blocks_needed(len(prompt) + 1) > cache.num_blocks:
            # (as for a chat: such a prompt would wait at the head of the queue for good)
            raise BadRequest(
                400,
                f"the prompt's {len(prompt)} tokens do not fit this engine's KV cache "
                f"({cache.num_blocks} blocks of {cache.block_size} tokens)",
                "input",
            )
        room = max_len - len(prompt)
        return prompt, room if limit is None else min(limit, room)

    # -- running a request -----------------------------------------------------------------------

    def _final(self, run: Run, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response, stored if the request asked for it."""
        sim = run.sim
        status = "incomplete" if (sim.finish_reason or "length") == "length" else "completed"
        block_size = self.server.profile.block_size
        use = usage(len(sim.prompt), len(run.out.token_ids), sim.cached_tokens, block_size)
        body = response_body(run.echo, run.created_at, status, output, use)
        if run.entry is not None:
            self.store.finish(run.entry, body)
        return body

    async def _collect(self, run: Run) -> dict[str, Any]:
        """Run a non-streamed request to its end; its response."""
        server, sim, channel, out = self.server, run.sim, run.channel, run.out
        first_real: float | None = None
        while not channel.done:
            tokens = await server._tokens(channel)
            if tokens and first_real is None:
                first_real = time.monotonic()
            for token in tokens:
                if out.add(token):
                    server.model.complete(sim, "stop")
                    channel.done = True
                    break
        server._observe(sim, first_real, time.monotonic(), len(out.token_ids))
        return self._final(run, [message_item(new_id("msg"), out.delta(True), "completed")])

    async def _events(self, run: Run) -> AsyncIterator[list[bytes]]:
        """A streamed request's events, a list per engine step that produced any; the opening
        ones at once, before the engine runs (as vLLM sends them)."""
        server, sim, channel, out = self.server, run.sim, run.channel, run.out
        stream = EventStream.start(run.echo, run.created_at)
        yield stream.opening()
        first_real: float | None = None
        last = 0.0
        while not channel.done:
            tokens = await server._tokens(channel)
            now = time.monotonic()
            if tokens:
                if first_real is None:
                    first_real = now
                else:
                    server.h_itl.observe(now - last)
                last = now
            events: list[bytes] = []
            for text, _, stopped in batch_deltas(out, tokens, channel.done):
                if stopped:
                    server.model.complete(sim, "stop")
                    channel.done = True
                events += stream.delta(text)
            if events:
                yield events
        events = stream.delta(out.delta(True))  # (held back for a stop string that never came)
        events += stream.closing(self._final(run, stream.output()))
        server._observe(sim, first_real, time.monotonic(), len(out.token_ids))
        yield events

    async def _stream(self, http: web.Request, run: Run) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE)
        await resp.prepare(http)
        try:
            async for events in self._events(run):
                await resp.write(b"".join(events))
        except ConnectionAbortedError:
            if http.transport is not None:
                http.transport.abort()  # a cut, not a clean end: the client must see the failure
            return resp
        except ConnectionResetError:
            return resp  # the client left: the caller's release aborts the request
        await resp.write_eof()
        return resp

    # -- background ------------------------------------------------------------------------------

    async def _start_background(
        self, http: web.Request, run: Run, entry: StoredResponse, stream: bool
    ) -> web.StreamResponse:
        entry.body = response_body(run.echo, run.created_at, "queued", [], None)
        entry.events = [] if stream else None
        self.store.put(entry)
        entry.task = asyncio.create_task(self._background_run(run, entry), name=f"response {entry.id}")
        self._background.add(entry.task)
        entry.task.add_done_callback(self._background.discard)
        if stream:
            return await self._replay(http, entry, 0)
        return _json(entry.body)

    async def _background_run(self, run: Run, entry: StoredResponse) -> None:
        try:
            if entry.events is None:
                await self._collect(run)
                return
            async for events in self._events(run):
                entry.events += events
                entry.changed.set()
        except ConnectionAbortedError:
            pass  # the engine died: the stored response stays "queued", as in vLLM
        finally:
            self.server.release(run.sim)
            entry.ended = True
            entry.changed.set()

    async def _replay(self, http: web.Request, entry: StoredResponse, index: int) -> web.StreamResponse:
        """A background stream's events from ``index`` on, as they come, to ``response.completed``
        (indexed like vLLM's deque of them). Where vLLM's replay fails after its 200 (not a
        background stream, an index out of range) the connection is cut; where it would wait for
        ever (the generation ended without completing: a cancel, a crash) too."""
        resp = web.StreamResponse(headers=_SSE)
        await resp.prepare(http)
        events = entry.events
        try:
            while events is not None:
                entry.changed.clear()
                while index < len(events):
                    event = events[index]
                    await resp.write(event)
                    if event.startswith(_COMPLETED):
                        await resp.write_eof()
                        return resp
                    index += 1
                if entry.ended:
                    break
                await entry.changed.wait()
        except IndexError:
            pass
        except ConnectionResetError:
            return resp
        if http.transport is not None:
            http.transport.abort()
        return resp

    # -- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel ----------------------------------

    async def retrieve(self, http: web.Request) -> web.StreamResponse:
        try:
            stream = _query_bool(http, "stream")
            starting_after = _query_int(http, "starting_after")
            entry = self.store.get(http.match_info["response_id"])
            if entry is None:
                raise not_found(http.match_info["response_id"])
        except BadRequest as exc:
            return _error(exc)
        if stream:
            return await self._replay(http, entry, 0 if starting_after is None else starting_after + 1)
        return _json(entry.body)

    async def cancel(self, http: web.Request) -> web.Response:
        response_id = http.match_info["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            return _error(not_found(response_id))
        if entry.body.get("status") not in ("queued", "in_progress"):
            # (a response that ran with its request, finished or not, is no background one)
            return _error(
                BadRequest(400, "Cannot cancel a synchronous response.", "response_id", INVALID_REQUEST)
            )
        entry.body["status"] = "cancelled"
        task = entry.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return _json(entry.body)


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _query_bool(http: web.Request, name: str) -> bool:
    text = http.query.get(name)
    if text is None or text.lower() in _FALSE:
        return False
    if text.lower() in _TRUE:
        return True
    msg = "Input should be a valid boolean, unable to interpret input"
    raise BadRequest(400, _query_message(name, "bool_parsing", msg, text), f"query.{name}", SCHEMA_ERROR)


def _query_int(http: web.Request, name: str) -> int | None:
    text = http.query.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        msg = "Input should be a valid integer, unable to parse string as an integer"
        raise BadRequest(
            400, _query_message(name, "int_parsing", msg, text), f"query.{name}", SCHEMA_ERROR
        ) from None


def _query_message(name: str, code: str, msg: str, text: str) -> str:
    error = {"type": code, "loc": f"query.{name}", "msg": msg, "input": text}
    return f"1 validation error:\n  {error}"
