"""Relaying an engine's answer: SSE bytes event by event, or one JSON body; usage capture.

Streamed events are relayed as the engine's bytes, never re-serialised. The only event the gateway
may drop is the usage-only final chunk it asked for on the client's behalf. Per chunk the hot path
is a few byte searches; JSON is parsed only for the few chunks that mention usage.

Timeouts of a stream, one deadline moved as it goes: until the first event, the first-token limit
(from dispatch); from the first event on, the idle limit between events. A client that stops
reading blocks the relay in ``send``; the same idle deadline then ends the stream and the engine
request is closed with it, so a slow reader never pins an engine and buffers stay bounded (the
upstream reader pauses the socket, the server's transport pauses the relay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from time import monotonic
from typing import Any

import aiohttp
import orjson

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.engines.base import json_object, read_up_to
from gateway.fleet.monitor import describe_failure
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.serving.call import Call, ClientGone, overhead_header
from gateway.serving.stream_state import Cut, StreamLedger
from gateway.serving.watchdog import time_limit, time_limit_at
from gateway.sse import OversizedEvent, SseFramer, sse_data
from gateway.tracing import EVENT_FIRST_TOKEN
from policies.migration import MigrationReason

log = logging.getLogger("slogate.relay")

JSON_HEADER = (b"content-type", b"application/json")
SSE_HEADERS = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)
#: an SSE event larger than this is an engine bug, not something to buffer without end...
MAX_EVENT_BYTES = 4 * 1024 * 1024
#: ...but for the prompt's token ids, which the first event may echo (``return_token_ids``, as
#: migration asks): up to ten digits and a comma each, and the prompt's count is an estimate
_ID_BYTES_PER_PROMPT_TOKEN = 16


def event_limit(prompt_tokens: int) -> int:
    """The longest SSE event a stream of a ``prompt_tokens`` prompt may carry."""
    return MAX_EVENT_BYTES + _ID_BYTES_PER_PROMPT_TOKEN * max(0, prompt_tokens)


#: how long a final error event may wait for a client that is not reading
_LAST_WORDS_S = 1.0


def upstream_error(status: int, body: bytes) -> GatewayError:
    """An engine's answer other than 200 as an OpenAI-shaped error: with the same status when it
    is an HTTP error (4xx, 5xx), else a 502. A 2xx other than 200 (a 204 is bodiless), a
    redirect, or a status HTTP does not define (uvicorn has no status line for 600: the client's
    connection was dropped with nothing sent) is no completion, and not the client's to read."""
    message = body.decode(errors="replace")[:2000] or f"engine returned HTTP {status}"
    if message.lstrip()[:1] == "<":
        # an HTML page (a proxy's error page in front of the engine): its markup is no message
        message = f"engine returned HTTP {status} (an HTML page: a proxy in front of it?)"
    if not 400 <= status <= 599:
        return GatewayError(502, f"engine answered HTTP {status}, not a completion", code="upstream_failed")
    code = None
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(body)
        if isinstance(data, dict):
            nested = data.get("error")
            inner: dict[str, Any] = nested if isinstance(nested, dict) else data
            said = inner.get("message") or inner.get("detail")
            # (a string only: str() of an engine's deeply nested value passed the recursion limit)
            message = said[:2000] if isinstance(said, str) and said else message
            code = inner.get("code") if isinstance(inner.get("code"), str) else None
    return GatewayError(status, message, code=code)


def record_usage(call: Call, usage: Any) -> None:
    """The engine's latest usage report for the call (a stream with ``continuous_usage_stats``
    repeats its running totals in every chunk; a migrated stream ends with its legs' totals):
    kept, not counted. :func:`count_usage` counts it once, when the request ends."""
    if not isinstance(usage, dict):
        return
    if "input_tokens" in usage and "prompt_tokens" not in usage:
        usage = _chat_usage(usage)
    call.usage = usage
    completion = usage.get("completion_tokens")
    if isinstance(completion, int) and not isinstance(completion, bool):
        call.completion_tokens = completion


def _chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A Responses API usage (``input_tokens``, ``output_tokens`` and their details) under the
    chat names the gateway counts by."""
    details = usage.get("input_tokens_details")
    chat: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "total_tokens": usage.get("total_tokens"),
    }
    if isinstance(details, dict):
        chat["prompt_tokens_details"] = {"cached_tokens": details.get("cached_tokens")}
    return chat


def count_usage(call: Call) -> None:
    """Add the call's usage to the token counters: once per request, whatever its engines sent."""
    usage, call.usage = call.usage, None
    if usage is None:
        return
    model = call.request.model
    metrics.deferred(metrics.TOKENS, model, "prompt").inc(_count(usage.get("prompt_tokens")))
    metrics.deferred(metrics.TOKENS, model, "completion").inc(_count(usage.get("completion_tokens")))
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        metrics.deferred(metrics.TOKENS, model, "cached").inc(_count(details.get("cached_tokens")))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


#: the largest whole (non-streamed) answer taken from an engine: an embeddings batch of 2,048
#: 4,096-dimension vectors as JSON floats is about 100 MB
MAX_PLAIN_BYTES = 256 << 20
#: ...and of an error answer (only its first 2,000 characters are shown)
MAX_ERROR_BYTES = 64 << 10


def stalled_error(engine_id: str) -> GatewayError:
    """The retryable error of an attempt whose wait was cut because its engine was marked stalled
    (:meth:`Call.cut_stalled_wait`); counted as such."""
    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stalled").inc()
    metrics.UPSTREAM_RETRIES.labels("stalled").inc()
    return GatewayError(504, f"engine {engine_id} stalled before it answered", code="upstream_timeout")


async def read_plain(call: Call, response: aiohttp.ClientResponse) -> bytes | GatewayError:
    """Read a whole JSON answer; a cut while reading it is retryable (the client saw nothing).
    The caller bounds the read with the request's deadline."""
    engine_id = call.engine_id or ""
    try:
        body, whole = await read_up_to(response, MAX_PLAIN_BYTES)
    except aiohttp.ClientError as exc:
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
        log.warning(
            "engine %s failed mid-response: %s",
            engine_id,
            describe_failure(exc),
            extra={"request_id": call.client_rid},
        )
        reason = describe_failure(exc)
        return GatewayError(502, f"engine {engine_id} failed mid-response: {reason}", code="upstream_failed")
    if not whole:
        # (an engine, or a proxy before it, answering without end: held whole it took the
        # gateway's memory, and every stream with it; another engine would answer the same)
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "too_large").inc()
        raise GatewayError(
            502, f"engine {engine_id} answered more than {MAX_PLAIN_BYTES} bytes", code="upstream_too_large"
        )
    if b'"usage"' in body:
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
            answer = orjson.loads(body)
            record_usage(call, answer.get("usage"))
            if call.request.kind == "responses":
                call.response_id = _response_id(answer)
    call.finished_at = monotonic()
    return body


async def answer_plain(call: Call, status: int, body: bytes, idle_s: float) -> int:
    """Send a read JSON answer to the client; one that takes none of it for ``idle_s`` is gone."""
    if call.watcher is not None:
        call.watcher.cancel()
    engine = (call.engine_id or "").encode()
    overhead = overhead_header(call, monotonic())
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [JSON_HEADER, *call.reply_headers, (b"x-slogate-engine", engine), overhead],
    }
    await send_bounded(call, start, idle_s)
    call.started = True
    await send_bounded(call, {"type": "http.response.body", "body": body}, idle_s)
    return status


async def send_bounded(call: Call, message: dict[str, Any], seconds: float) -> None:
    """``call.send`` that gives up on a client that has not taken anything for ``seconds``."""
    try:
        async with time_limit(call.watchdog, seconds):
            await call.send(message)
    except TimeoutError:
        metrics.SLOW_CLIENTS.inc()
        raise ClientGone() from None


async def relay_stream(
    call: Call,
    response: aiohttp.ClientResponse,
    fleet: Fleet,
    record: EngineRecord,
    first_token_at: float,
    idle_s: float,
    ledger: StreamLedger | None = None,
    cuttable: bool = False,
) -> int | Cut | GatewayError:
    """Relay an SSE stream until ``[DONE]``; returns the status the client was given.

    ``first_token_at`` is the loop-time deadline for the first event. Raises :class:`ClientGone`
    when the client stopped reading for ``idle_s``. With a ``ledger`` (a stream that may migrate)
    every relayed chunk is recorded in it, and an engine failure, a stall after the first event or
    a slack move returns a :class:`Cut` instead of ending the stream: the caller resumes it or
    ends it with the error the cut carries. ``cuttable``: until its first event the wait may be
    cut for a stalled engine (:meth:`Call.cut_stalled_wait`); it then returns a retryable error
    (the stream's headers may have gone out, from this attempt or one cut before it, but no event:
    the next attempt's events are the client's whole answer).
    """
    send = call.send
    request = call.request
    entry = call.entry
    engine_id = call.engine_id or ""
    if cuttable and call.stall_cut:
        # (cut as the engine's headers came: no start for the client, whose answer goes elsewhere)
        return stalled_error(engine_id)
    if not call.started:  # (an attempt after a stalled one that sent only the headers: sent)
        overhead = overhead_header(call, monotonic())
        # bounded like every later send: behind a large answer on the same connection (HTTP/1.1
        # pipelining) that the client is not reading, even the headers wait for the socket to drain
        await send_bounded(
            call,
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    *SSE_HEADERS,
                    *call.reply_headers,
                    (b"x-slogate-engine", engine_id.encode()),
                    overhead,
                ],
            },
            idle_s,
        )
        call.started = True
    clock = asyncio.get_running_loop().time
    done = False
    sending = False
    events = 0
    tracking = ledger is not None and ledger.tracking
    # a Responses API stream: typed events, its end the response's final event (no [DONE])
    responses = request.kind == "responses"
    moved: Cut | None = None
    errored = False  # the engine reported a failure in band (relayed as it came: no ledger)
    try:
        async with time_limit_at(call.watchdog, first_token_at) as deadline:
            if tracking:
                ledger.deadline = deadline  # type: ignore[union-attr]
            if cuttable:
                call.wait_on_engine(deadline, engine_id, True)
            rearmed_at = 0.0
            rearm_every = min(0.25, idle_s / 4)
            read = response.content.readany
            framer = SseFramer(event_limit(request.prompt_tokens))
            frame = framer.feed
            while chunk := await read():
                complete = frame(chunk)
                if not complete:
                    continue
                if cuttable and call.stall_cut:
                    # (cut while this came: the attempt is over, nothing of it is counted or sent)
                    return stalled_error(engine_id)
                sep = framer.sep
                now = monotonic()
                failed_at = -1
                if responses:
                    complete, done, n, content, failed_at = _response_events(call, complete, sep)
                    errored = errored or failed_at >= 0
                # (a JSON string escapes its quotes: '"error"' is an event's own key or the
                # "object" of an error response, never text)
                elif (
                    b'"usage":' in complete
                    or b"[DONE]" in complete
                    or b'"error"' in complete
                    or _ABORTED in complete
                    # (llama.cpp's own error field, _engine_error_field: a field starts a line, and
                    # JSON escapes a newline in a string, so generated text never matches)
                    or complete[:6] == b"error:"
                    or b"\nerror:" in complete
                    or complete[:1] == b":"
                    or b"\n:" in complete  # (a comment line: no data line starts with a colon)
                ):
                    complete, done, n, content, failed_at = _final_events(call, complete, sep)
                else:
                    n = content = complete.count(sep)
                if content and not call.first_at and not responses and b'"role"' in complete:
                    # vLLM's chat streams open with an event carrying only the role: no token (as
                    # one, every such stream's TPOT read (N - 1) / N of its real value)
                    content -= _role_only_events(complete, sep)
                # (an error is no first token, nor is a keep-alive comment; an empty answer's
                # [DONE] is where its first token would have been)
                if not call.first_at and (content or (done and failed_at < 0)):
                    call.first_at = now
                    fleet.mark_prefilled(engine_id, call.rid)
                    metrics.deferred(metrics.TTFT, request.model, call.target.slo_class).observe(
                        now - call.arrival
                    )
                    if call.upstream_span is not None:
                        call.upstream_span.add_event(EVENT_FIRST_TOKEN)
                if content and tracking:
                    ledger.stall_cut = False  # type: ignore[union-attr]  # (it is no longer stalled)
                if content and call.first_at and now - rearmed_at > rearm_every:
                    # (by content from the first token on: a keep-alive comment, before it or
                    # after, held a stalled stream and its engine for as long as they came)
                    # moved at most every quarter of the limit (<= 0.25 s), since this runs per
                    # chunk; the quarter is added so a silence is cut late, never early
                    deadline.reschedule(clock() + idle_s + rearm_every)
                    rearmed_at = now
                if failed_at >= 0 and not responses:
                    # vLLM reports a failure mid-stream in band: an error event, then [DONE]. Not
                    # a finished answer: what came before it goes out, the rest is a failure
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
                    reported = _error_message(complete[failed_at:].split(sep, 1)[0])
                    engine_error = GatewayError(
                        502, f"engine {engine_id} failed mid-stream: {reported}", code="upstream_failed"
                    )
                    if ledger is not None:
                        complete, done, moved = (
                            complete[:failed_at],
                            False,
                            Cut(MigrationReason.FAILURE, engine_id, engine_error),
                        )
                    else:
                        errored = True
                if content:
                    call.last_at = now
                    call.content_events += content
                    if call.request.choices > 1:
                        _count_choices(call, complete, sep)
                    if entry is not None:
                        fleet.add_generated(record, entry, content)
                events += n
                if complete:
                    if cuttable:  # (an event goes out: no longer cut for a stall)
                        call.engine_wait = None
                    sending = True
                    if tracking:
                        ledger.deadline = None  # type: ignore[union-attr]  # (not waiting on the engine)
                        if ledger.stall_cut:  # type: ignore[union-attr]
                            # (a cut asked for just before these bytes came: not in the send)
                            deadline.reschedule(clock() + idle_s)
                    await send({"type": "http.response.body", "body": complete, "more_body": True})
                    sending = False
                    if tracking:
                        ledger.deadline = deadline  # type: ignore[union-attr]
                        if ledger.stall_cut:  # type: ignore[union-attr]
                            deadline.reschedule(clock())  # the cut held back during the send
                if done:
                    break  # an engine that holds the connection open after [DONE] is not waited for
                if moved is not None:  # (a failure in band: its events before it are in the ledger)
                    if tracking and complete:  # (none before it: the stream may still restart)
                        ledger.feed(complete, content, now)  # type: ignore[union-attr]
                    break
                if tracking and ledger.feed(complete, content, now):  # type: ignore[union-attr]
                    placed = await ledger.move(now)  # type: ignore[union-attr]
                    if placed is not None:
                        moved = Cut(MigrationReason.SLACK, engine_id, None, placed)
                        break
    except TimeoutError:
        if cuttable:  # (a cut now would run out the error event's send limit instead)
            call.engine_wait = None
        call.sse_events = events  # (the error event is numbered after them)
        if ledger is not None:
            ledger.deadline = None  # (the limit is over: what follows has limits of its own)
        if cuttable and call.stall_cut:  # (before its first event, so not while sending)
            return stalled_error(engine_id)
        if sending:
            metrics.SLOW_CLIENTS.inc()
            log.info("client stopped reading; stream ended", extra={"request_id": call.client_rid})
            raise ClientGone() from None
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
        what = "sent no first token" if not call.first_at else "stalled between events"
        error = GatewayError(504, f"engine {engine_id} {what} in time", code="upstream_timeout")
        if ledger is not None and call.first_at:
            return Cut(MigrationReason.STALL, engine_id, error)
        await end_with_error(call, error)
        return 504
    except OversizedEvent:
        if cuttable:
            call.engine_wait = None
        call.sse_events = events  # (the error event is numbered after them)
        if ledger is not None:
            ledger.deadline = None
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
        await end_with_error(
            call, GatewayError(502, f"engine {engine_id} sent an oversized event", code="upstream_failed")
        )
        return 502
    except aiohttp.ClientError as exc:
        if cuttable:
            call.engine_wait = None
        call.sse_events = events  # (the error event is numbered after them)
        if ledger is not None:
            ledger.deadline = None
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
        error = GatewayError(502, f"engine {engine_id} failed mid-stream: {exc!r}", code="upstream_failed")
        if ledger is not None:
            return Cut(MigrationReason.FAILURE, engine_id, error)
        await end_with_error(call, error)
        return 502
    finally:
        if cuttable:
            call.engine_wait = None
        metrics.SSE_EVENTS.inc(events)
        call.sse_events = events
        if ledger is not None:
            ledger.deadline = None
    if moved is not None:
        return moved
    if cuttable and call.stall_cut:
        # (the engine closed as the cut came: nothing went out, so it is tried elsewhere all the same)
        return stalled_error(engine_id)
    if not done and not errored:
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
        error = GatewayError(
            502, f"engine {engine_id} ended the stream before it was complete", code="upstream_failed"
        )
        if ledger is not None:
            return Cut(MigrationReason.FAILURE, engine_id, error)
        await end_with_error(call, error)
        return 502
    if call.watcher is not None:
        call.watcher.cancel()
    call.finished_at = monotonic()
    if call.completion_tokens is not None and not errored:
        record.note_tokens_per_event(call.completion_tokens, call.content_events)
    # the engine's part is over: its capacity goes back before a slow client takes the last bytes
    fleet.release(engine_id, call.rid)
    # (an engine's error event went out already: [DONE] after it if the engine closed without)
    last = b"" if done or responses else b"data: [DONE]\n\n"
    await send_bounded(call, {"type": "http.response.body", "body": last, "more_body": False}, idle_s)
    return 502 if errored else response.status


def _final_events(call: Call, complete: bytes, sep: bytes) -> tuple[bytes, bool, int, int, int]:
    """Read usage from the final chunk; drop the usage-only event if the client did not ask, and
    whatever follows ``[DONE]``.

    Returns the bytes to relay, whether ``[DONE]`` came, the events relayed, how many of them
    before any error carry content (neither ``[DONE]`` nor usage only nor an error nor a
    comment), and where in the bytes the first error event begins (-1: none).
    """
    done = False
    kept: list[bytes] = []
    content = 0
    failed_at = -1
    for event in complete.split(sep)[:-1]:
        payload = sse_data(event)
        if payload.strip() == b"[DONE]":
            done = True
            kept.append(event + sep)
            break  # (the end of the stream: what an engine sends after it is not relayed)
        if event[:1] == b":" and _is_comment(event):
            kept.append(event + sep)  # a keep-alive comment: relayed, no output
            continue
        if payload.startswith(b"error:"):
            event = _engine_error_field(payload)
            payload = sse_data(event)
        if (b'"error"' in payload and _is_error(payload)) or _ABORTED in payload:
            if failed_at < 0:
                failed_at = sum(map(len, kept))
        elif b'"usage":' in payload and b'"usage":null' not in payload:
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                chunk = orjson.loads(payload)
                record_usage(call, chunk.get("usage"))
                if not chunk.get("choices"):
                    # (after an engine's error event nothing is relayed: not told then)
                    call.usage_told = call.usage_told or failed_at < 0
                    if not call.request.client_wants_usage:
                        continue
                    kept.append(event + sep)
                    continue
            content += failed_at < 0
        else:
            # (output after an engine's error event is not counted: a migrating stream relays
            # only what came before it, and what it counted went into its ledger)
            content += failed_at < 0
        kept.append(event + sep)
    return b"".join(kept), done, len(kept), content, failed_at


#: a choice the engine aborted (its own pause or abort, a sleep with mode=abort): no finished
#: answer but a failure, which a migratable stream resumes elsewhere (taken for the end, the client
#: got a truncated answer as a whole one)
_ABORTED = b'"finish_reason":"abort"'


def _engine_error_field(event: bytes) -> bytes:
    """An ``error: {...}`` event (llama-server builds of 2024-25 end a failed stream so, then
    ``[DONE]``) as the ``data: {"error": {...}}`` event every OpenAI client reads: a client's SSE
    parser ignores a field it does not know, so the stream looked like an empty completion and
    the engine's message was lost (and the relay counted the event as output, a first token)."""
    raw = event[6:].strip()
    with contextlib.suppress(orjson.JSONDecodeError, orjson.JSONEncodeError):
        said = orjson.loads(raw)
        if isinstance(said, dict) and isinstance(said.get("message"), str):
            return b"data: " + orjson.dumps({"error": said})
    message = raw.decode(errors="replace")[:2000] or "the engine failed"
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "upstream_error"}})


def _is_comment(event: bytes) -> bool:
    """Whether an SSE event is only comment lines (``: ping``), which proxies and some servers
    send to keep a connection alive: no output, no first token."""
    return all(line[:1] == b":" for line in event.splitlines() if line)


def role_only(choice: object) -> bool:
    """A streamed choice whose delta announces the role and carries no output (no content, no
    tool call, no reasoning): the event vLLM opens a chat stream with, before the first token."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return (
        isinstance(delta, dict)
        and "role" in delta
        and not any(value for key, value in delta.items() if key != "role")
    )


def _role_only_events(complete: bytes, sep: bytes) -> int:
    """How many events of ``complete`` are role announcements only (see :func:`role_only`):
    decoded only for a stream's first chunk that names a role."""
    count = 0
    for event in complete.split(sep)[:-1]:
        payload = sse_data(event)
        if b'"role"' not in payload or not payload.startswith(b"{"):
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            data = orjson.loads(payload)
            choices = data.get("choices") if isinstance(data, dict) else None
            if isinstance(choices, list) and choices and all(role_only(c) for c in choices):
                count += 1
    return count


def _count_choices(call: Call, complete: bytes, sep: bytes) -> None:
    """A stream of several choices: its content events per choice index, the longest of which is
    the number of engine steps (a choice that ends sends no more). Decoded only here, for the
    few streams that ask for several choices."""
    counts = call.choice_events
    if counts is None:
        counts = call.choice_events = {}
    for event in complete.split(sep)[:-1]:
        payload = sse_data(event)
        if not payload.startswith(b"{"):
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            data = orjson.loads(payload)
            choices = data.get("choices") if isinstance(data, dict) else None
            for choice in choices if isinstance(choices, list) else ():
                index = choice.get("index") if isinstance(choice, dict) else None
                if isinstance(index, int) and not role_only(choice):
                    counts[index] = counts.get(index, 0) + 1


def _is_error(payload: bytes) -> bool:
    """An engine's error event: ``{"error": {...}}`` (vLLM's streams), or an error response
    itself (``{"object": "error", ...}``, as older vLLM wrote one)."""
    head = payload.lstrip()
    if head.startswith(b'{"error"'):
        return True
    if not head.startswith(b'{"object"'):
        return False
    data = json_object(payload)
    return data is not None and data.get("object") == "error"


def _error_message(event: bytes) -> str:
    """What an engine's error event says, for the client's error (bounded; the raw bytes when
    it is not the JSON it should be)."""
    payload = sse_data(event)
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return repr(payload[:200])
    inner = data.get("error", data) if isinstance(data, dict) else data
    message = inner.get("message") if isinstance(inner, dict) else None
    # (a string only: str() of an engine's deeply nested value passed the recursion limit)
    return message[:500] if isinstance(message, str) else repr(payload[:200])


async def end_with_error(call: Call, error: GatewayError) -> None:
    """End a started stream with an error event; a client that does not take it is gone."""
    if call.watcher is not None:
        # the server reports a disconnect once the response is complete: watched still, the
        # handler's clean-up after this was cancelled and the error counted as the client's
        call.watcher.cancel()
    try:
        async with time_limit(call.watchdog, _LAST_WORDS_S):
            await call.send(
                {
                    "type": "http.response.body",
                    "body": stream_error(call, error),
                    "more_body": False,
                }
            )
    except TimeoutError:
        raise ClientGone() from None


# -- Responses API streams -------------------------------------------------------------------------

#: a Responses stream's event types that end it: the response is done (whole, or cut by its
#: token limit), or failed
_RESPONSE_ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')
#: every output event's type ends so (``response.output_text.delta``, a reasoning or a tool call's
#: arguments delta): one an engine step. Counted on the ``event:`` lines, which JSON text cannot
#: fake (it has no raw newline); ``_DELTA`` within the data only for a server that writes no
#: ``event:`` lines (where a client's text ending in ".delta" would count too)
_DELTA_LINE = b".delta\n"
_DELTA_LINE_CRLF = b".delta\r\n"
_DELTA = b'.delta"'


def _deltas(events: bytes) -> int:
    if b"event:" in events:
        return events.count(_DELTA_LINE) + events.count(_DELTA_LINE_CRLF)
    return events.count(_DELTA)


def _response_events(call: Call, complete: bytes, sep: bytes) -> tuple[bytes, bool, int, int, int]:
    """:func:`_final_events` for a Responses API stream (``event: <type>`` then ``data: {...}``,
    no ``[DONE]``): the bytes to relay, whether the stream ended, the events, how many carry
    output, and where the first failure event begins (-1: none; the stream ends with it)."""
    n = complete.count(sep)
    content = _deltas(complete)
    if not (
        b'"error"' in complete
        or any(end in complete for end in _RESPONSE_ENDS)
        or complete[:1] == b":"
        or b"\n:" in complete
    ):
        return complete, False, n, content, -1
    kept: list[bytes] = []
    content = comments = 0
    for event in complete.split(sep)[:-1]:
        kept.append(event + sep)
        if event[:1] == b":" and _is_comment(event):
            comments += 1  # (relayed; no event of the response, nor numbered as one)
            continue
        payload = _event_data(event)
        kind = _response_event_type(payload)
        if kind == "error" or kind == "response.failed":
            return b"".join(kept), True, len(kept) - comments, content, sum(map(len, kept[:-1]))
        if kind in ("response.completed", "response.incomplete"):
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                response = orjson.loads(payload).get("response")
                if isinstance(response, dict):
                    record_usage(call, response.get("usage"))
                    call.response_id = _response_id(response)
            call.usage_told = True
            # (nothing after the end is relayed)
            return b"".join(kept), True, len(kept) - comments, content, -1
        content += kind is not None and kind.endswith(".delta")
    return b"".join(kept), False, len(kept) - comments, content, -1


def _event_data(event: bytes) -> bytes:
    """The data of an SSE event that may open with an ``event:`` line (its type)."""
    if event.startswith(b"data:"):
        return sse_data(event)
    at = event.find(b"\ndata:")
    return sse_data(event[at + 1 :]) if at >= 0 else b""


def _response_event_type(payload: bytes) -> str | None:
    """A Responses stream event's type, from its data (read only for the few chunks that may end
    the stream; an error object without a type, as some servers write a failure, is an error)."""
    data = json_object(payload) if payload.startswith(b"{") else None
    if data is None:
        return None
    kind = data.get("type")
    if isinstance(kind, str):
        return kind
    return "error" if "error" in data and data["error"] is not None else None


def _response_id(response: Any) -> str | None:
    value = response.get("id") if isinstance(response, dict) else None
    return value if isinstance(value, str) and value else None


def stream_error(call: Call, error: GatewayError) -> bytes:
    """The last bytes of a started stream that ends with ``error``: for chat and completions an
    error event and ``[DONE]``; for a Responses stream its ``error`` event (what the OpenAI SDK
    reads as one), numbered after the events relayed."""
    if call.request.kind != "responses":
        return error.sse_event() + b"data: [DONE]\n\n"
    event = {
        "type": "error",
        "code": error.code or str(error.status),
        "message": error.message,
        "param": error.param,
        "sequence_number": call.sse_events,
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
