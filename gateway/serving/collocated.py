"""The collocated flow: place the request on an engine that prefills and decodes, relay its answer.

Before the first byte reaches the client an attempt may fail over to another engine: the engine
refused the connection (it is ejected), its pooled connection turned out closed twice, it answered
503 (overloaded or asleep), or it cut a non-streamed answer. Attempts are bounded in number
(``dispatch_attempts``) and, for non-streamed requests, in total time (``request_timeout_s`` from
arrival, across every attempt). A timeout after the request reached an engine is never retried:
the engine may still be working on it, and repeating it would double the work it was too slow
for. Failing to get a connection in time is retried: nothing was sent. So is a wait the gateway
ends because the engine was found stalled (:meth:`Call.cut_stalled_wait`) while nothing of the
answer had reached the client: that engine is doing no work, and waiting hung the request.

Timeouts: getting a connection (``pool_timeout_s`` waiting for a pooled one plus
``connect_timeout_s`` opening one: aiohttp bounds both together), response headers of a stream
(``headers_timeout_s``), its first event (``first_token_timeout_s`` from dispatch), silence between
events (``idle_timeout_s``, also a client that stops reading), the whole of a non-streamed request
(``request_timeout_s``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway import metrics
from gateway.api.errors import GatewayError, encode_body
from gateway.dashboard.decisions import DecisionLog
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.slo_service import SloService
from gateway.engines.base import PRIORITY_EPOCH_S, read_up_to
from gateway.fleet.monitor import describe_failure
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from gateway.open_files import out_of_sockets
from gateway.serving.call import Call, ClientGone
from gateway.serving.migration import Migrator
from gateway.serving.outliers import OutlierEjector
from gateway.serving.relay import (
    MAX_ERROR_BYTES,
    answer_plain,
    read_plain,
    relay_stream,
    stalled_error,
    upstream_error,
)
from gateway.serving.stream_state import Cut
from gateway.serving.watchdog import time_limit_at
from gateway.settings import Settings
from gateway.tracing import (
    SPAN_DISPATCH,
    SPAN_QUEUE_WAIT,
    UPSTREAM_SPANS,
    Span,
    SpanKind,
    Tracing,
    fail,
    now_ns,
)
from policies.api import RequestView

#: the error code of a request refused for the gateway's own shortage of sockets
OVERLOADED = "gateway_overloaded"
REQUEST_TIMEOUT = "request_timeout"


def out_of_time(timeout_s: float, engine: str = "an engine") -> GatewayError:
    """A non-streamed request's whole time (``request_timeout_s``) ran out before it reached
    ``engine``: sent now, that engine would do the work and be blamed for a timeout that was
    the gateway's (its queue, a KV transfer's turn)."""
    return GatewayError(
        504,
        f"the request's {timeout_s:g} s (request_timeout_s) ran out before it reached {engine}",
        code=REQUEST_TIMEOUT,
    )


#: at most one warning this often (seconds) for those refusals: they come in bursts
_SHORTAGE_LOG_EVERY_S = 1.0
_shortage_logged = [-math.inf, 0]  # (when the last warning went out, refusals since)

log = logging.getLogger("slogate.serving")


def _shortage(call: Call, engine_id: str, exc: aiohttp.ClientConnectorError) -> None:
    """Count a refusal for want of a socket, and say so at most once a second."""
    metrics.child(metrics.SHEDS, call.target.slo_class, "gateway_resources").inc()
    _shortage_logged[1] += 1
    now = time.monotonic()
    if now - _shortage_logged[0] >= _SHORTAGE_LOG_EVERY_S:
        log.warning(
            "no socket for engine %s (%d refused since the last warning): %s",
            engine_id,
            _shortage_logged[1],
            exc.os_error,
            extra={"request_id": call.client_rid},
        )
        _shortage_logged[0], _shortage_logged[1] = now, 0


PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
#: one placement's work: (call, engine placed, its reservation, the request's deadline or None)
#: -> the status sent to the client, or a retryable error
Stage = Callable[[Call, EngineRecord, RunningEntry, float | None], Awaitable[int | GatewayError]]
#: fields only the P/D flow may set: a client's own would make an engine pull KV from a host the
#: client chose, or hold its KV blocks for a lease as a prefill engine does
HANDOVER_FIELDS = frozenset(("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"))


def _shared_offset() -> float:
    return time.time() - time.monotonic() - PRIORITY_EPOCH_S


class CollocatedFlow:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        dispatch: DispatchLoop,
        slo: SloService,
        session: aiohttp.ClientSession,
        tracing: Tracing,
        decisions: DecisionLog | None = None,
        fresh_session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.dispatch = dispatch
        self.slo = slo
        self.session = session
        #: a session that never reuses a connection, for the one retry after a pooled connection
        #: the engine had closed (the pool may hold more such, e.g. the monitor's parallel reads)
        self.fresh_session = fresh_session or session
        self.tracing = tracing
        #: recent placements for /dashboard (None: not kept)
        self.decisions = decisions
        #: what the dispatch span and the decision log call the dispatcher
        self.dispatcher = dispatcher_name(settings)
        #: what turns a deadline on the monotonic clock into seconds since PRIORITY_EPOCH_S on the
        #: wall clock (read per request: the two clocks drift apart by seconds a day under NTP)
        self.shared_offset: Callable[[], float] = _shared_offset
        # aiohttp's ``connect`` covers waiting for a pooled connection and opening a new one
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.pool_timeout_s + settings.connect_timeout_s,
            sock_connect=settings.connect_timeout_s,
        )
        #: decode migration (resumes cut streams on other engines); None when migration_limit is 0
        self.migration = Migrator(self) if settings.migration_limit > 0 else None
        #: takes an engine whose requests fail in a row out of rotation for a while
        self.outliers = OutlierEjector(fleet, settings.outlier_params())

    async def serve(self, call: Call, stage: Stage | None = None) -> int:
        """Place and relay ``call``; returns the status sent, raises GatewayError before any byte.

        ``stage`` serves one placement (default :meth:`attempt`: the whole request on the engine
        placed); the disaggregated flow passes its own, which runs a prefill engine's part and
        then the decode stage, so both flows share placement, retries and their bookkeeping.
        """
        request = call.request
        target = call.target
        serve_on = self.attempt if stage is None else stage
        view = RequestView(
            request_id=call.rid,
            model=request.model,
            prompt_tokens=request.prompt_tokens,
            max_output_tokens=request.max_tokens,
            arrival=call.arrival,
            priority=call.queue_priority,
            task=target.slo_class,
            tenant=call.tenant,
            lora=request.lora,
            engine=call.pinned,
        )
        settings = self.settings
        deadline = None if request.stream else call.arrival + settings.request_timeout_s
        tried: list[str] = []
        last_error: GatewayError | None = None
        loop = asyncio.get_running_loop()
        batch = None if call.slo_batch is None else (call.tenant, call.slo_batch)
        for attempt in range(1, settings.dispatch_attempts + 1):
            entry = RunningEntry(request.prompt_tokens, request.max_tokens, target.tpot_s, 0.0)
            entry.stream = request.stream
            asked = time.monotonic()
            asked_ns = now_ns() if call.span is not None else 0
            # runs only if place() yields to the loop, i.e. the request waited in the queue: that
            # wait is the dispatcher's holding, not the gateway's own time
            suspended = _Flag()
            loop.call_soon(suspended.set)
            try:
                record = await self.dispatch.place(
                    view, target.ttft_s, target.tpot_s, target.slo_class, entry, tried, batch
                )
            except GatewayError as error:
                self._decided(call, attempt, asked, asked_ns, suspended.value, None, error, tried)
                if not tried or not self.fleet.has_healthy(request.model):
                    raise  # nothing serves the model any more: say so, not the last failure
                break  # no other engine for a retry: report the engine's failure
            try:
                # (inside: a failure recording the decision must not keep the engine's seat)
                self._decided(call, attempt, asked, asked_ns, suspended.value, record, None, tried)
                tried.append(record.engine_id)
                if deadline is not None and time.monotonic() >= deadline:
                    raise out_of_time(settings.request_timeout_s)  # (it waited its time in the queue)
                outcome = await serve_on(call, record, entry, deadline)
            finally:
                self.dispatch.release(record.engine_id, call.rid)
            if isinstance(outcome, int):
                return outcome
            last_error = outcome
            if deadline is not None and time.monotonic() >= deadline:
                break
        raise last_error or self.dispatch.no_engine(request.model)

    def _decided(
        self,
        call: Call,
        attempt: int,
        asked: float,
        asked_ns: int,
        queued: bool,
        record: EngineRecord | None,
        error: GatewayError | None,
        tried: list[str],
    ) -> None:
        """A placement came back: count a queue wait as not the gateway's own time, log the
        decision for /dashboard and, when tracing, record its spans. Never raises: what only
        observes a request must not fail it (nor leave the engine it was placed on reserved)."""
        waited = time.monotonic() - asked
        if queued:
            call.waited_s += waited
        try:
            self._record_decision(call, attempt, asked_ns, waited, queued, record, error, tried)
        except Exception:
            log.exception("recording a dispatch decision failed", extra={"request_id": call.client_rid})

    def log_decision(
        self,
        call: Call,
        attempt: int,
        engine_id: str | None,
        refused: str | None,
        queue_wait_s: float,
        tried: Sequence[str],
    ) -> None:
        """A placement in /dashboard's decision log, when one is kept (every flow's placements
        come here). Never raises: what only observes a request must not fail it."""
        if self.decisions is None:
            return
        try:
            self.decisions.add(call, attempt, engine_id, refused, queue_wait_s, tuple(tried))
        except Exception:
            log.exception("recording a dispatch decision failed", extra={"request_id": call.client_rid})

    def _record_decision(
        self,
        call: Call,
        attempt: int,
        asked_ns: int,
        waited: float,
        queued: bool,
        record: EngineRecord | None,
        error: GatewayError | None,
        tried: list[str],
    ) -> None:
        engine_id = record.engine_id if record is not None else None
        code = None if error is None else error.code or str(error.status)
        self.log_decision(call, attempt, engine_id, code, waited if queued else 0.0, tried)
        span = call.span
        if span is None:
            return
        tracing = self.tracing
        end_ns = asked_ns + int(waited * 1e9)
        attributes: dict[str, Any] = {
            "slogate.attempt": attempt,
            "slogate.dispatcher": self.dispatcher,
            "slogate.queued": queued,
            "slogate.slo_class": call.target.slo_class,
            # a client's model name is bounded to what the fleet serves, as on the request span
            "gen_ai.request.model": (
                call.request.model if call.request.model in self.fleet.served_models else "(unknown)"
            ),
        }
        if tried:
            attributes["slogate.excluded_engines"] = tuple(tried)
        if record is not None:
            attributes["slogate.engine"] = record.engine_id
            # the engine's load as the decision left it (this request's reservation included)
            attributes["slogate.engine.in_flight"] = record.in_flight
            free_kv = record.free_kv_tokens()
            if free_kv is not None:
                attributes["slogate.engine.free_kv_tokens"] = free_kv
            if call.decision is not None and call.decision.engine_id == record.engine_id:
                attributes.update(call.decision.attributes())
        if queued:
            attributes["slogate.queue_wait_ms"] = round(waited * 1000.0, 3)
        dispatch = tracing.child(span, SPAN_DISPATCH, attributes, start_ns=asked_ns)
        if queued:
            wait = tracing.child(
                dispatch, SPAN_QUEUE_WAIT, {"slogate.slo_class": call.target.slo_class}, start_ns=asked_ns
            )
            wait.end(end_ns)
        if error is not None:
            fail(dispatch, error.code, error.status)
        dispatch.end(end_ns)

    def body_for(
        self,
        call: Call,
        record: EngineRecord,
        overrides: dict[str, Any] | None = None,
        remove: tuple[str, ...] = (),
        late: bool = False,
    ) -> bytes:
        """The bytes to send upstream: the client's own, with at most a member or two spliced in.

        Members of a JSON object are unordered, so a field the body lacks is inserted right after
        its opening brace; re-serialising a 15 MB body would block the event loop for 7-26 ms.
        Only a body that must lose a field (a ``priority`` the engine would reject) or already
        has the one to change is re-serialised. ``overrides`` and ``remove`` are a stage's own
        changes (a P/D prefill's ``max_tokens``, ``kv_transfer_params``...): they go into a copy,
        so the client's body stays what it was for the next stage.
        """
        request = call.request
        adapter = record.adapter
        # a body parsed in a worker is decoded here only if it must change: its keys say whether
        keys = request.keys if request.parsed is None else request.parsed.keys()
        if "priority" in keys and not adapter.accepts_priority and adapter.prepare_body(request.body):
            request.body_edited = True  # a field was removed: only re-serialising can do that
        extra: dict[str, Any] = {}
        if adapter.accepts_priority:
            # The engine orders its own queue by this: the request's TTFT deadline (a late one's
            # after every on-time one), as the dispatcher ordered them; on a time base every
            # replica shares (each counting from its own start, a replica started later sent
            # smaller numbers, and a shared engine ran its requests first whatever their deadlines)
            deadline = call.arrival + call.target.ttft_s + self.shared_offset()
            extra["priority"] = adapter.deadline_priority(deadline, late)
        stream = request.stream if overrides is None else bool(overrides.get("stream", request.stream))
        if stream and not request.client_wants_usage:  # (a Responses stream always tells usage)
            extra["stream_options"] = {"include_usage": True}
        if stream and call.ledger is not None and call.ledger.tracking:
            extra["return_token_ids"] = True  # decode migration resumes from the relayed token ids
        if overrides:
            extra.update(overrides)
        smuggled = HANDOVER_FIELDS.intersection(keys)
        if smuggled:
            remove = (*remove, *smuggled)
        if not extra and not remove:
            return encode_body(request.body) if request.body_edited else request.raw
        if overrides or remove or request.body_edited or any(key in keys for key in extra):
            body = request.body
            if "stream_options" in extra:
                extra["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            # a copy: what goes to this engine (its priority, token ids a migration needs) must
            # not reach a retry's, which may be of a kind that refuses it
            return encode_body({**{k: v for k, v in body.items() if k not in remove}, **extra})
        # parse_request accepted a JSON object with a "model": it opens with "{" and has a member
        at = request.raw.index(b"{") + 1
        return b"".join((request.raw[:at], orjson.dumps(extra)[1:-1], b",", request.raw[at:]))

    def headers_for(self, call: Call, record: EngineRecord) -> dict[str, str]:
        adapter = record.adapter
        forwarded = adapter.forwarded_headers(call.forward_headers) if call.forward_headers else None
        return adapter.upstream_headers(call.rid, forwarded)

    async def attempt(
        self,
        call: Call,
        record: EngineRecord,
        entry: RunningEntry,
        deadline: float | None,
        overrides: dict[str, Any] | None = None,
    ) -> int | GatewayError:
        """The whole request (with a decode stage's ``overrides`` of the body) on one engine.
        Returns the status sent to the client, or a retryable error. A stream that may migrate
        and leaves this engine mid-answer is resumed elsewhere (see :mod:`gateway.serving.migration`)."""
        request = call.request
        engine_id = record.engine_id
        migration = self.migration
        call.ledger = migration.ledger(call, record) if migration is not None else None
        payload = self.body_for(call, record, overrides, late=entry.late)
        headers = self.headers_for(call, record)
        url = record.adapter.url(PATHS[request.kind])
        call.dispatched_at = entry.dispatched_at = time.monotonic()
        call.engine_id = engine_id
        call.entry = entry
        call.stall_cut = False
        metrics.deferred(metrics.DISPATCHES, engine_id).inc()
        loop = asyncio.get_running_loop()
        settings = self.settings
        if deadline is None:
            # a stream: its headers come first, then its first event, each with its own limit
            first_token_at = loop.time() + settings.first_token_timeout_s
            headers_at = min(first_token_at, loop.time() + settings.headers_timeout_s)
        else:
            first_token_at = headers_at = loop.time() + (deadline - time.monotonic())
        up = self.upstream_span(call, record, url, headers) if call.span is not None else None
        try:
            outcome = await self._exchange(
                call, record, url, payload, headers, headers_at, first_token_at, up, overrides is not None
            )
        except BaseException as exc:
            if up is not None:
                end_upstream(up, call, exc)
            self.outliers.judge_raised(engine_id, exc)
            raise
        if up is not None:
            end_upstream(up, call, outcome)
        self.outliers.judge(engine_id, outcome, call)
        if isinstance(outcome, Cut):  # the stream started and left this engine: resume it elsewhere
            assert self.migration is not None
            self.dispatch.release(engine_id, call.rid)  # this engine's part is over (idempotent)
            return await self.migration.resume(call, outcome, [engine_id])
        return outcome

    def upstream_span(self, call: Call, record: EngineRecord, url: str, headers: dict[str, str]) -> Span:
        """The upstream call's span; the engine is sent its context as ``traceparent``."""
        assert call.span is not None
        adapter = record.adapter
        parsed = urlsplit(url)  # host and port only: an engine URL may carry credentials
        attributes: dict[str, Any] = {
            "slogate.engine": record.engine_id,
            "slogate.engine.kind": adapter.kind,
            "slogate.engine.role": adapter.role.value,
            "server.address": parsed.hostname or "",
            "url.path": parsed.path,
            "http.request.method": "POST",
        }
        if parsed.port is not None:
            attributes["server.port"] = parsed.port
        span = self.tracing.child(call.span, UPSTREAM_SPANS[adapter.role], attributes, kind=SpanKind.CLIENT)
        Tracing.inject(span, headers)
        call.upstream_span = span
        return span

    async def post(
        self,
        call: Call,
        record: EngineRecord,
        url: str,
        payload: bytes,
        headers: dict[str, str],
        headers_at: float,
        count_wait: bool = True,
        cuttable: bool = False,
    ) -> aiohttp.ClientResponse | GatewayError:
        """POST to the engine until its response headers; a retryable failure comes back as a
        GatewayError (connecting failed, the engine closed a pooled connection twice, a malformed
        answer); a timeout after the request reached the engine raises (never retried).
        ``count_wait``: the wait is not the gateway's own time (False for a request sent beside
        another, whose wait is counted once). ``cuttable``: the wait for the headers is the
        call's wait on its engine (:attr:`Call.engine_wait`), cut when the engine is marked
        stalled: that is retryable."""
        engine_id = record.engine_id
        sent_at = time.monotonic()
        try:
            for fresh in (False, True):
                try:
                    async with time_limit_at(call.watchdog, headers_at) as limit:
                        if cuttable:
                            call.wait_on_engine(limit, engine_id, call.request.stream)
                        # (never redirects: the engine's key would go with the request elsewhere)
                        response = await (self.fresh_session if fresh else self.session).post(
                            url, data=payload, headers=headers, timeout=self._timeout, allow_redirects=False
                        )
                    return response
                except aiohttp.ConnectionTimeoutError:
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "connect_timeout").inc()
                    metrics.UPSTREAM_RETRIES.labels("connect").inc()
                    return GatewayError(
                        504, f"could not connect to engine {engine_id} in time", code="upstream_timeout"
                    )
                except aiohttp.ClientConnectorError as exc:
                    if out_of_sockets(exc):
                        # the gateway's own shortage, not the engine's: ejecting every engine for
                        # it turned a burst into an outage. Every engine fails alike: no retry.
                        _shortage(call, engine_id, exc)
                        raise GatewayError(
                            503,
                            "the gateway is out of connections; retry later",
                            code=OVERLOADED,
                            retry_after_s=1.0,
                        ) from None
                    if exc.os_error.errno == errno.EADDRNOTAVAIL:
                        # no local port or address for this engine's address: others may still
                        # be reachable (ports run out per destination), and the monitor's health
                        # checks judge whether this one can be reached at all
                        _shortage(call, engine_id, exc)
                        return GatewayError(
                            503,
                            f"no local address or port to reach engine {engine_id}; retry later",
                            code=OVERLOADED,
                            retry_after_s=1.0,
                        )
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "connect").inc()
                    metrics.UPSTREAM_RETRIES.labels("connect").inc()
                    reason = describe_failure(exc)
                    record.adapter.note_refusal(exc)
                    self.fleet.eject(engine_id, reason)
                    log.warning(
                        "engine %s unreachable: %s", engine_id, reason, extra={"request_id": call.client_rid}
                    )
                    return GatewayError(
                        502, f"engine {engine_id} is unreachable", code="upstream_unreachable"
                    )
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    # Most often a pooled keep-alive connection the engine had already closed: try
                    # once more on this engine before calling it a failure (the monitor judges it).
                    # (or the engine died holding the request: it may have been read)
                    call.upstream_reached = True
                    metrics.UPSTREAM_RETRIES.labels("stale_connection" if not fresh else "cut").inc()
                    if not fresh:
                        continue
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "connect").inc()
                    return GatewayError(
                        502, f"engine {engine_id} closed the connection: {exc!r}", code="upstream_failed"
                    )
                except TimeoutError:
                    call.upstream_reached = True
                    if cuttable and call.stall_cut:
                        return stalled_error(engine_id)
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
                    raise GatewayError(
                        504, f"engine {engine_id} did not answer in time", code="upstream_timeout"
                    ) from None
                except aiohttp.ClientError as exc:
                    call.upstream_reached = True
                    # a malformed answer (bad status line or headers): nothing reached the client,
                    # another engine may do
                    metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "protocol").inc()
                    log.warning(
                        "engine %s sent a malformed answer: %s",
                        engine_id,
                        type(exc).__name__,
                        extra={"request_id": call.client_rid},
                    )
                    return GatewayError(
                        502, f"engine {engine_id} sent a malformed answer", code="upstream_failed"
                    )
        finally:
            if cuttable:
                call.engine_wait = None
            if count_wait:
                call.waited_s += time.monotonic() - sent_at  # connecting and the engine's headers
        raise AssertionError("unreachable: the second try returns or raises")

    async def _exchange(
        self,
        call: Call,
        record: EngineRecord,
        url: str,
        payload: bytes,
        headers: dict[str, str],
        headers_at: float,
        first_token_at: float,
        up: Span | None,
        decode_stage: bool = False,
    ) -> int | GatewayError | Cut:
        """Send the request to the engine and relay its answer (see :meth:`attempt`);
        ``decode_stage``: a P/D decode stage's (its engine may read the KV handed over)."""
        request = call.request
        engine_id = record.engine_id
        settings = self.settings
        call.upstream_answered = call.upstream_reached = False
        # (a decode stage's wait is not cut for a stall: its engine may have read the KV handed over)
        cuttable = not decode_stage
        response = await self.post(call, record, url, payload, headers, headers_at, cuttable=cuttable)
        if isinstance(response, GatewayError):
            return response
        # (an answer on a fresh connection after a stale pooled one: the stale one was not read)
        call.upstream_reached = False
        call.upstream_answered = response.status == 200
        if up is not None:
            up.set_attribute("http.response.status_code", response.status)
        try:
            if response.status != 200:  # (any other status is no answer: engine_refused)
                return await self.engine_refused(
                    call, record, response, headers_at, retry_500=not decode_stage
                )
            if response.content_type == "text/html":
                # a page (a proxy's sign-in or maintenance page, a catch-all route), no completion:
                # relayed, a plain answer reached the client as a 200 "completion" of HTML, and a
                # stream as HTML cut at blank lines; another engine may do
                metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "status").inc()
                return GatewayError(
                    502,
                    f"engine {engine_id} answered with an HTML page, not a completion",
                    code="upstream_failed",
                )
            if request.stream and response.content_type == "application/json":
                refused, whole = await self.engine_did_not_stream(call, record, response, headers_at)
                if whole:
                    # (the whole answer, generated: another engine would generate it again, and
                    # again; an error object under a 200 may go to another engine)
                    raise refused
                return refused
            if request.stream:
                return await relay_stream(
                    call,
                    response,
                    self.fleet,
                    record,
                    first_token_at,
                    settings.idle_timeout_s,
                    call.ledger,
                    cuttable,
                )
            read_at = time.monotonic()
            try:
                async with time_limit_at(call.watchdog, first_token_at) as limit:
                    if cuttable:
                        call.wait_on_engine(limit, engine_id, False)
                    body = await read_plain(call, response)
            except TimeoutError:
                if cuttable and call.stall_cut:
                    return stalled_error(engine_id)
                metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
                raise GatewayError(
                    504, f"engine {engine_id} did not finish in time", code="upstream_timeout"
                ) from None
            finally:
                if cuttable:  # (a P/D decode's read must not drop its prefill's wait, in another task)
                    call.engine_wait = None
                call.waited_s += time.monotonic() - read_at  # the engine writing its answer
            if isinstance(body, GatewayError):
                return body
            # the engine's part is over: its capacity goes back before the client's part (an
            # answer shows no first token; its end shows the prefill was done)
            self.fleet.mark_prefilled(engine_id, call.rid)
            self.dispatch.release(engine_id, call.rid)
            return await answer_plain(call, response.status, body, settings.idle_timeout_s)
        finally:
            response.close()  # also aborts the engine's request if it is still running

    async def engine_did_not_stream(
        self, call: Call, record: EngineRecord, response: aiohttp.ClientResponse, deadline: float
    ) -> tuple[GatewayError, bool]:
        """A streamed request that the engine answered with a JSON body (an error object under a
        200, as some servers and proxies send, or a whole answer): an error that carries the
        engine's message, before any stream has begun (a stream would end with a bare "ended
        before it was complete" and lose it)."""
        body = await error_body(call, response, deadline)
        metrics.child(metrics.UPSTREAM_ERRORS, record.engine_id, "status").inc()
        reported = upstream_error(502, body)
        refused = GatewayError(
            502,
            f"engine {record.engine_id} answered a streamed request without a stream: {reported.message}",
            code="upstream_failed",
        )
        # and whether that was a completion (its choices), not an error object
        return refused, b'"choices"' in body or b'"object":"response"' in body

    async def engine_refused(
        self,
        call: Call,
        record: EngineRecord,
        response: aiohttp.ClientResponse,
        deadline: float,
        count_wait: bool = True,
        retry_500: bool = True,
    ) -> GatewayError:
        """The error an engine's refusal (any status but 200) comes to; ``count_wait`` as for
        :meth:`post`; ``retry_500``: the engine's own 500 may go to another engine (not a P/D
        decode stage's: the engine may have read the KV handed over, which no other holds)."""
        engine_id = record.engine_id
        body = await error_body(call, response, deadline, count_wait)
        metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "status").inc()
        status = response.status
        if status == 503:  # overloaded or asleep: another engine may do
            metrics.UPSTREAM_RETRIES.labels("overloaded").inc()
            return upstream_error(status, body)
        if status == 500 and retry_500:
            # the engine's own failure, before anything reached the client: another engine may
            # do (bounded by dispatch_attempts; an engine that fails every request is taken out
            # of rotation by the outlier ejection). Not a 502 or 504: behind a proxy those may
            # come after the engine did the work, and a gateway as the engine retried already
            metrics.UPSTREAM_RETRIES.labels("engine_error").inc()
            return upstream_error(status, body)
        if status in (401, 403):
            # the engine refuses the gateway's own credentials (its api_key here is wrong or was
            # rotated there): not the client's to fix. Relayed as they came, the client read a
            # 401 authentication_error of its own and the SDK gave up on its key; another engine
            # may do (the monitor takes this one out: its model list is refused too)
            metrics.UPSTREAM_RETRIES.labels("engine_auth").inc()
            return GatewayError(
                502,
                f"engine {engine_id} refused the gateway's credentials (HTTP {status}); the api_key "
                "configured for it may be wrong",
                code="upstream_auth_failed",
            )
        lora = call.request.lora
        if status == 404 and lora is not None and lora in record.adapters:
            # the adapter was unloaded since the engine's model list was last read: it leaves that
            # engine's list now (the next read confirms it), and another engine that has it may do
            self.fleet.set_adapters(engine_id, record.adapters - {lora})
            metrics.UPSTREAM_RETRIES.labels("adapter_gone").inc()
            return upstream_error(status, body)
        if status in (404, 405) and call.request.kind == "embeddings":
            raise GatewayError(
                400,
                f"model {call.request.model!r} does not serve embeddings (engine {engine_id} has no "
                "embeddings endpoint)",
                param="model",
                code="model_not_supported",
            )
        if status in (404, 405) and call.request.kind == "responses" and _route_missing(body):
            # (a 404 of the API itself names a response it does not have: that one is relayed)
            raise GatewayError(
                400,
                f"model {call.request.model!r} is not served with the Responses API (engine "
                f"{engine_id} has no /v1/responses endpoint)",
                param="model",
                code="model_not_supported",
            )
        raise upstream_error(status, body)


def _route_missing(body: bytes) -> bool:
    """Whether a 404 answer says the path is unknown (a web framework's own "Not Found"), not
    that the API knows no such item (an OpenAI-shaped error with a message of its own)."""
    text = body.strip()
    if not text.startswith(b"{"):
        return True  # (a plain-text or empty 404: no API answered)
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return True
    return isinstance(data, dict) and data.get("detail") == "Not Found"


async def error_body(
    call: Call, response: aiohttp.ClientResponse, deadline: float, count_wait: bool = True
) -> bytes:
    """An engine's error answer, read within a second past ``deadline`` (empty if it is not sent
    by then, or the connection fails); its time counts as waiting on the engine unless
    ``count_wait`` is False (a request sent beside another, whose wait is counted once)."""
    read_at = time.monotonic()
    try:
        async with time_limit_at(call.watchdog, max(deadline, asyncio.get_running_loop().time() + 1.0)):
            return (await read_up_to(response, MAX_ERROR_BYTES))[0]
    except (TimeoutError, aiohttp.ClientError):
        return b""
    finally:
        if count_wait:
            call.waited_s += time.monotonic() - read_at


class _Flag:
    """A bool a loop callback can set (``loop.call_soon(flag.set)``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False

    def set(self) -> None:
        self.value = True


def dispatcher_name(settings: Settings) -> str:
    """The routing profile's name, for spans and the dashboard (a path names its file)."""
    return Path(settings.routing_profile).stem


def end_upstream(span: Span, call: Call, result: int | GatewayError | Cut | BaseException) -> None:
    """End an upstream span with how the attempt ended (the engine's own status is on it)."""
    if call.content_events:
        span.set_attribute("slogate.content_events", call.content_events)
    if isinstance(result, GatewayError):
        fail(span, result.code or str(result.status))
    elif isinstance(result, Cut):  # the stream left this engine (decode migration)
        span.set_attribute("slogate.migration.left", result.reason.value)
        if result.error is not None:
            fail(span, result.error.code or str(result.error.status))
    elif isinstance(result, ClientGone | asyncio.CancelledError):
        span.set_attribute("error.type", "client_disconnected")
    elif isinstance(result, BaseException):
        fail(span, type(result).__name__)
    elif result >= 500:  # the stream had started and ended with an error event
        fail(span, "stream_failed")
    span.end()
