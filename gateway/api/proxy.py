"""The OpenAI data path: authorise, parse, pick an engine, relay the engine's answer.

Streaming responses are relayed as the engine's SSE bytes, event by event, never re-serialised.
The only event the gateway may drop is the usage-only final chunk it asked for on the client's
behalf. A client disconnect cancels the upstream request at once; an engine failure before the
first byte is retried on another engine; a failure after it ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.api.request_parse import ParsedRequest, RouteKind, parse_request
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.slo_service import SloService
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from gateway.settings import Settings
from gateway.tracing import Tracing
from policies.api import RequestView
from policies.slo import SloTarget

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("slogate.proxy")

_PATHS: dict[RouteKind, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: client headers relayed upstream: W3C trace context and the simulated engine's controls
_FORWARDED_PREFIXES = (b"x-sim-", b"traceparent", b"tracestate")
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


def _new_request_id() -> str:
    return os.urandom(12).hex()


def _status_class(status: int) -> str:
    return f"{status // 100}xx"


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, or a 413 as soon as it exceeds ``limit`` bytes."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        return body
    chunks = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_json(
    send: Send, status: int, body: bytes, request_id: bytes, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"x-request-id", request_id), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: GatewayError, request_id: bytes) -> None:
    extra: tuple[tuple[bytes, bytes], ...] = ()
    if error.retry_after_s is not None:
        extra = ((b"retry-after", str(max(1, round(error.retry_after_s))).encode()),)
    await send_json(send, error.status, error.body(), request_id, extra)


def _upstream_error(status: int, body: bytes) -> GatewayError:
    """An engine's non-2xx answer as an OpenAI-shaped error with the same status."""
    message = body.decode(errors="replace")[:2000] or f"engine returned HTTP {status}"
    code = None
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(body)
        if isinstance(data, dict):
            nested = data.get("error")
            inner: dict[str, Any] = nested if isinstance(nested, dict) else data
            message = str(inner.get("message") or message)
            code = inner.get("code") if isinstance(inner.get("code"), str) else None
    return GatewayError(status, message, code=code)


@dataclass(slots=True)
class Call:
    """Everything the proxy tracks about one request while it is served."""

    request: ParsedRequest
    rid: str
    rid_bytes: bytes
    arrival: float
    send: Send
    watcher: asyncio.Task[bool]
    target: SloTarget
    #: effective priority (header or body, clamped to the SLO profile's levels); None if not given
    priority: int | None = None
    reply_headers: tuple[tuple[bytes, bytes], ...] = ()
    dispatched_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    content_events: int = 0
    engine_id: str | None = None
    batch_tokens: int = 0
    batch_size: int = 0
    #: prompts dispatched to the same engine and not yet prefilled when this one was sent
    prefill_ahead: tuple[int, ...] = ()


class Proxy:
    """Shared by the three OpenAI routes; one instance per app."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        dispatch: DispatchLoop,
        slo: SloService,
        session: aiohttp.ClientSession,
        tracing: Tracing,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.dispatch = dispatch
        self.slo = slo
        self.session = session
        self.tracing = tracing
        self.api_keys = {f"Bearer {k}".encode() for k in settings.api_keys}
        self._epoch = time.monotonic()
        self._stream_timeout = aiohttp.ClientTimeout(sock_connect=settings.connect_timeout_s)
        self._plain_timeout = aiohttp.ClientTimeout(
            total=settings.request_timeout_s, sock_connect=settings.connect_timeout_s
        )

    # -- entry -----------------------------------------------------------------------------------

    async def handle(self, kind: RouteKind, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id") or _new_request_id().encode()
        model = "-"
        status = 500
        try:
            if self.api_keys and headers.get(b"authorization") not in self.api_keys:
                raise GatewayError(401, "invalid or missing API key", code="invalid_api_key")
            if scope["method"] != "POST":
                raise GatewayError(405, f"{scope['path']} accepts POST only", code="method_not_allowed")
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
                raise GatewayError(
                    413,
                    f"request body exceeds {self.settings.max_body_bytes} bytes",
                    code="request_too_large",
                )
            raw = await read_body(receive, self.settings.max_body_bytes)
            request = parse_request(kind, raw, self.settings.default_max_tokens)
            request.forward_headers = {
                k.decode(): v.decode() for k, v in scope["headers"] if k.startswith(_FORWARDED_PREFIXES)
            }
            # label by served model only, so arbitrary client strings cannot grow the metric set
            model = request.model if request.model in self.fleet.served_models else "(unknown)"
            target, priority = self.slo.classify(headers, request.priority)
            status = await self._serve(request, target, priority, rid, arrival, receive, send)
        except GatewayError as error:
            status = error.status
            await send_error(send, error, rid)
        except ClientGone:
            status = 499
            metrics.CLIENT_DISCONNECTS.inc()
        except Exception:
            # A bug, not a client or engine problem: still an OpenAI-shaped answer, never a bare
            # traceback page. If the response had already started the send fails and the
            # connection is closed, which the client sees as a cut stream.
            status = 500
            log.exception("internal error", extra={"request_id": rid.decode()})
            with contextlib.suppress(Exception):
                internal = GatewayError(500, "internal gateway error; see its log", code="internal_error")
                await send_error(send, internal, rid)
        finally:
            metrics.child(metrics.REQUESTS, kind, model, _status_class(status)).inc()
            if status < 400:
                metrics.child(metrics.REQUEST_LATENCY, model).observe(time.monotonic() - arrival)
            if self.settings.log_requests:
                log.info("request done", extra={"request_id": rid.decode(), "model": model, "status": status})

    # -- dispatch with retries before the first byte ---------------------------------------------

    def _body_for(self, call: Call, record: EngineRecord) -> bytes:
        """The bytes to send upstream: the client's own unless this engine needs a change."""
        request = call.request
        body = request.body
        changed = record.adapter.prepare_body(body)
        if record.adapter.accepts_priority:
            # The engine orders its own queue by this: the request's TTFT deadline in ms since the
            # gateway started, so the engine's order agrees with the gateway's deadline orders.
            deadline_ms = int((call.arrival + call.target.ttft_s - self._epoch) * 1000)
            body["priority"] = record.adapter.engine_priority(deadline_ms)
            changed = True
        if request.stream and not request.client_wants_usage:
            options = body.get("stream_options") or {}
            body["stream_options"] = {**options, "include_usage": True}
            changed = True
        return orjson.dumps(body) if changed else request.raw

    async def _serve(
        self,
        request: ParsedRequest,
        target: SloTarget,
        priority: int | None,
        rid_bytes: bytes,
        arrival: float,
        receive: Receive,
        send: Send,
    ) -> int:
        rid = rid_bytes.decode()
        view = RequestView(
            request_id=rid,
            model=request.model,
            prompt_tokens=request.prompt_tokens,
            max_output_tokens=request.max_tokens,
            arrival=arrival,
            priority=0 if priority is None else priority,
            task=target.slo_class,
        )
        relay = asyncio.current_task()
        assert relay is not None
        watcher = asyncio.create_task(_watch_disconnect(receive, relay))
        reply = (
            (b"x-request-id", rid_bytes),
            (b"x-slo-class", target.slo_class.encode()),
            (b"x-slo-ttft-ms", b"%d" % round(target.ttft_s * 1000)),
            (b"x-slo-tpot-ms", b"%d" % round(target.tpot_s * 1000)),
        )
        call = Call(request, rid, rid_bytes, arrival, send, watcher, target, priority, reply)
        self.slo.started(priority)
        tried: list[str] = []
        last_error: GatewayError | None = None
        status = 500
        try:
            for _ in range(self.settings.dispatch_attempts):
                with self.tracing.span("dispatch", request_id=rid, slo_class=target.slo_class):
                    with self.tracing.span("queue_wait", request_id=rid):
                        try:
                            record = await self.dispatch.place(
                                view, target.ttft_s, target.tpot_s, target.slo_class, tried
                            )
                        except GatewayError:
                            if not tried:
                                raise
                            break  # a retry found no other engine: report the engine's failure
                    tried.append(record.engine_id)
                    outcome = await self._try_engine(call, record)
                if isinstance(outcome, int):
                    status = outcome
                    return outcome
                last_error = outcome
            raise last_error or self.dispatch.no_engine(request.model)
        except GatewayError as error:
            status = error.status
            raise
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled() and watcher.result():
                relay.uncancel()
                metrics.CLIENT_DISCONNECTS.inc()
                status = 499
                return 499
            raise
        finally:
            watcher.cancel()
            self._account(call, status)

    def _account(self, call: Call, status: int) -> None:
        """Feed SLO metrics, the priority mapper and the latency model with what was observed."""
        self.slo.left(call.priority)
        if status == 499:
            self.slo.finished(call.target, call.priority, None, None, None, 0.0, 0, 0, 0)
            return
        observed = call.request.stream and status == 200 and call.first_at > 0
        ttft = call.first_at - call.arrival if observed else None
        tpot = (
            (call.last_at - call.first_at) / (call.content_events - 1)
            if observed and call.content_events > 1
            else None
        )
        if status == 200 and not call.request.stream:
            return  # no token timing without a stream: nothing to judge the SLO by
        queue_s = (call.dispatched_at - call.arrival) if call.dispatched_at else 0.0
        self.slo.finished(
            call.target,
            call.priority,
            call.engine_id,
            ttft,
            tpot,
            queue_s,
            call.request.prompt_tokens,
            call.batch_tokens,
            call.batch_size,
            call.prefill_ahead,
        )

    async def _try_engine(self, call: Call, record: EngineRecord) -> int | GatewayError:
        """Send to one engine. Returns the status sent to the client, or a retryable error."""
        request = call.request
        adapter = record.adapter
        engine_id = record.engine_id
        payload = self._body_for(call, record)
        call.dispatched_at = time.monotonic()
        call.engine_id = engine_id
        entry = RunningEntry(
            request.prompt_tokens, request.max_tokens, call.target.tpot_s, call.dispatched_at
        )
        running = record.running.values()
        call.batch_size = len(record.running) + 1
        call.batch_tokens = sum(r.prompt_tokens + r.generated for r in running) + request.prompt_tokens
        call.prefill_ahead = tuple(r.prompt_tokens for r in running if not r.prefilled)
        self.fleet.on_dispatch(engine_id, call.rid, entry)
        metrics.child(metrics.DISPATCHES, engine_id).inc()
        try:
            with self.tracing.span("upstream", request_id=call.rid, engine=engine_id):
                try:
                    response = await self.session.post(
                        adapter.url(_PATHS[request.kind]),
                        data=payload,
                        headers=adapter.upstream_headers(call.rid, request.forward_headers),
                        timeout=self._stream_timeout if request.stream else self._plain_timeout,
                    )
                except _CONNECT_ERRORS as exc:
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "connect").inc()
                    self.fleet.eject(engine_id, repr(exc))
                    log.warning("engine %s unreachable: %r", engine_id, exc, extra={"request_id": call.rid})
                    return GatewayError(
                        502, f"engine {engine_id} is unreachable", code="upstream_unreachable"
                    )
                except TimeoutError:
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
                    return GatewayError(
                        504, f"engine {engine_id} did not answer in time", code="upstream_timeout"
                    )
                try:
                    if response.status >= 400:
                        body = await response.read()
                        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "status").inc()
                        error = _upstream_error(response.status, body)
                        if response.status == 503:  # overloaded or sleeping: another engine may do
                            return error
                        raise error
                    if request.stream:
                        return await self._relay_stream(call, response, entry)
                    return await self._relay_plain(call, response)
                finally:
                    response.close()
        finally:
            self.fleet.on_finish(engine_id, call.rid)
            self.dispatch.finished(engine_id)

    # -- relays ----------------------------------------------------------------------------------

    async def _relay_plain(self, call: Call, response: aiohttp.ClientResponse) -> int | GatewayError:
        """Relay a whole JSON answer; a cut while reading it is retryable (the client saw nothing)."""
        engine_id = call.engine_id or ""
        try:
            body = await response.read()
        except TimeoutError:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
            raise GatewayError(
                504, f"engine {engine_id} did not finish in time", code="upstream_timeout"
            ) from None
        except aiohttp.ClientError as exc:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
            log.warning("engine %s failed mid-response: %r", engine_id, exc, extra={"request_id": call.rid})
            return GatewayError(
                502, f"engine {engine_id} failed mid-response: {exc!r}", code="upstream_failed"
            )
        if b'"usage"' in body:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                _record_usage(call.request.model, orjson.loads(body).get("usage"))
        call.watcher.cancel()
        await call.send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [_JSON, *call.reply_headers, (b"x-slogate-engine", engine_id.encode())],
            }
        )
        await call.send({"type": "http.response.body", "body": body})
        return response.status

    async def _relay_stream(self, call: Call, response: aiohttp.ClientResponse, entry: RunningEntry) -> int:
        send = call.send
        request = call.request
        engine_id = call.engine_id or ""
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*_SSE_HEADERS, *call.reply_headers, (b"x-slogate-engine", engine_id.encode())],
            }
        )
        loop = asyncio.get_running_loop()
        idle = self.settings.idle_timeout_s
        done = False
        events = 0
        pending = b""
        try:
            async with asyncio.timeout_at(loop.time() + self.settings.first_token_timeout_s) as deadline:
                last_rearm = loop.time()
                async for chunk in response.content.iter_any():
                    data = pending + chunk if pending else chunk
                    end = data.rfind(b"\n\n")
                    if end < 0:
                        pending = data
                        continue
                    complete, pending = data[: end + 2], data[end + 2 :]
                    now = time.monotonic()
                    if not call.first_at:
                        call.first_at = now
                        entry.prefilled = True
                        metrics.child(metrics.TTFT, request.model).observe(now - call.arrival)
                    if now - last_rearm > 0.5:  # re-arm rarely: the idle limit is seconds, not µs
                        deadline.reschedule(loop.time() + idle)
                        last_rearm = now
                    if b'"usage":' in complete or b"[DONE]" in complete:
                        complete, done = self._final_events(request, complete)
                    n = complete.count(b"\n\n")
                    if n and not done:
                        call.last_at = now
                        call.content_events += n
                        entry.generated += n
                    events += n
                    if complete:
                        await send({"type": "http.response.body", "body": complete, "more_body": True})
        except TimeoutError:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
            await self._end_with_error(
                send, GatewayError(504, f"engine {engine_id} stalled for too long", code="upstream_timeout")
            )
            return 504
        except aiohttp.ClientError as exc:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
            await self._end_with_error(
                send,
                GatewayError(502, f"engine {engine_id} failed mid-stream: {exc!r}", code="upstream_failed"),
            )
            return 502
        finally:
            metrics.SSE_EVENTS.inc(events)
        if not done:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
            await self._end_with_error(
                send,
                GatewayError(
                    502, f"engine {engine_id} ended the stream before it was complete", code="upstream_failed"
                ),
            )
            return 502
        call.watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return response.status

    def _final_events(self, request: ParsedRequest, complete: bytes) -> tuple[bytes, bool]:
        """Read usage from the final chunk; drop the usage-only event if the client did not ask.

        Only the few byte ranges that mention usage or [DONE] get here, so the per-event hot
        path stays a byte search.
        """
        done = False
        kept: list[bytes] = []
        for event in complete.split(b"\n\n")[:-1]:
            payload = event[6:] if event.startswith(b"data: ") else event
            if payload.strip() == b"[DONE]":
                done = True
            elif b'"usage":' in payload and b'"usage":null' not in payload:
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                    chunk = orjson.loads(payload)
                    _record_usage(request.model, chunk.get("usage"))
                    if not request.client_wants_usage and not chunk.get("choices"):
                        continue
            kept.append(event + b"\n\n")
        return b"".join(kept), done

    async def _end_with_error(self, send: Send, error: GatewayError) -> None:
        await send(
            {
                "type": "http.response.body",
                "body": error.sse_event() + b"data: [DONE]\n\n",
                "more_body": False,
            }
        )


def _record_usage(model: str, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    metrics.child(metrics.TOKENS, model, "prompt").inc(usage.get("prompt_tokens") or 0)
    metrics.child(metrics.TOKENS, model, "completion").inc(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        metrics.child(metrics.TOKENS, model, "cached").inc(details.get("cached_tokens") or 0)


async def _watch_disconnect(receive: Receive, relay: asyncio.Task[Any]) -> bool:
    """Cancel the relay task when the client goes away; True when it did.

    The body has been read by now, so the next ASGI message can only be the disconnect. The
    relay cancels this watcher before it sends its last byte, because the server also reports
    a disconnect once the response is complete.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            relay.cancel()
            return True
