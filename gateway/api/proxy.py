"""The OpenAI front door: authorise, parse, classify, hand the request to its flow, answer.

Every request gets the gateway's own id (the dispatch key and the id engines see); the client's
``X-Request-Id`` is kept for correlation only (returned, logged, in spans), so two requests that
carry the same one stay two requests. A client disconnect cancels the flow at once, which closes
the upstream request. Every outcome is answered OpenAI-shaped: GatewayErrors with their status,
anything unexpected as a 500 that never shows a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from gateway import metrics
from gateway.api.auth import Authenticator, forwardable_headers
from gateway.api.body_budget import BodyBudget, BodyLease
from gateway.api.errors import GatewayError, send_error
from gateway.api.parse_offload import BodyParser
from gateway.api.request_parse import RouteKind
from gateway.dispatch.core import NO_HEALTHY_ENGINE, model_not_found, no_healthy_engine
from gateway.dispatch.slo_service import SloService, header_text
from gateway.fleet.engine_tokenizer import PromptKeyer
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.fleet.prompt_key import prompt_blocks
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.router import Decision, Router
from gateway.serving.call import OVERHEAD_HEADER, Call, ClientGone, Receive, Scope, Send, overhead_header
from gateway.serving.disaggregated import DisaggregatedFlow
from gateway.serving.relay import count_usage, end_with_error
from gateway.serving.responses import Responses
from gateway.serving.stream_state import StreamLedger
from gateway.serving.watchdog import Watchdog, time_limit
from gateway.settings import Settings
from gateway.tracing import Span, fail, now_ns
from policies.latency_fit import predict_prefill
from policies.plugins.affinity import affinity_key
from policies.stall import may_try_elsewhere

log = logging.getLogger("slogate.proxy")

#: how long an error answer may wait for a client that does not read
_ERROR_SEND_S = 5.0

#: a client request id we echo back: visible ASCII without separators a log line could trip on
_CLIENT_ID = re.compile(rb"[\x21-\x7e]{1,128}")


def _status_class(status: int) -> str:
    # (a client that left is told apart from a client mistake, as the metric's help says)
    return "499" if status == 499 else f"{status // 100}xx"


async def read_body(receive: Receive, limit: int, lease: BodyLease | None = None) -> bytes:
    """The whole request body, or a 413 as soon as it exceeds ``limit`` bytes; with ``lease``,
    its bytes are held against the gateway's body budget as they come (a 503 past it)."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        if len(body) > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        if lease is not None:
            lease.take_up_to(len(body))
        return body
    chunks = [body]
    size = len(body)
    while True:
        if lease is not None:
            lease.take_up_to(size)
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body"):
            if lease is not None:
                lease.take_up_to(size)
            return b"".join(chunks)


class Proxy:
    """Shared by the three OpenAI routes; one instance per app."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        slo: SloService,
        flow: DisaggregatedFlow,
        auth: Authenticator,
        prefix: PrefixRouting | None = None,
        router: Router | None = None,
        responses: Responses | None = None,
    ) -> None:
        self.settings = settings
        #: engines whose stalled requests are being moved (the ejection notifies again)
        self._sweeping: set[str] = set()
        #: where stored Responses API answers live (a gateway without one pins nothing)
        self.responses = responses or Responses(
            fleet, flow.collocated.session, settings.headers_timeout_s, settings.idle_timeout_s
        )
        self.fleet = fleet
        self.slo = slo
        self.flow = flow
        self.auth = auth
        #: the prefix index and affinity store the router reads (None: the profile reads neither)
        self.prefix = prefix
        #: the router, for ``x-slogate-debug`` decisions (None: no decisions reported)
        self.router = router
        keyed = prefix is not None and prefix.index is not None
        #: keys prompts for the prefix index (each model's engine tokenizer, else the gateway's)
        self.keyer = PromptKeyer(settings.engine_tokenizers)
        self.bodies = BodyBudget(settings.max_body_memory_bytes)
        self.parser = BodyParser(
            settings.offload_parse_bytes,
            settings.default_max_tokens,
            prompt_ids=keyed,
            engine_tokenizers=self.keyer.directories,
        )
        self._boot = os.urandom(4).hex()
        self._ids = itertools.count(1)
        #: the parsing worker's tokenizer directories with the LoRA adapters' (their base model's),
        #: for the fleet's adapters of the time (rebuilt when those change)
        self._tokenizers_for: dict[str, str] | None = None
        self._tokenizers: Mapping[str, str] | None = None
        #: requests being served (past parsing) and their handler tasks, by gateway id: what a
        #: shutdown ends once its grace is over
        self._open: dict[str, tuple[Call, asyncio.Task[Any]]] = {}
        #: handler tasks still receiving or parsing their request (not served yet), by gateway id
        self._receiving: dict[str, asyncio.Task[Any]] = {}
        #: a shutdown's grace ran out: what is still open is ended, later requests are refused
        self.cut = False
        fleet.listeners.append(self._on_engine_change)

    @property
    def open_requests(self) -> int:
        return len(self._open) + len(self._receiving)

    def cut_open(self) -> int:
        """A shutdown's grace is over: each open request ends now, a started stream with an
        error event and [DONE], any other with a 503 (its engine request aborted, its queue
        place or reservation given back, as when a client leaves); later ones are refused.
        Returns how many it ended."""
        self.cut = True
        # (one cut already is ending; one whose engine part is over is sending its last bytes,
        # and uvicorn's backstop bounds a client that does not take them)
        open_now = [(c, task) for c, task in self._open.values() if not c.cut and not c.finished_at]
        for call, task in open_now:
            call.cut = True
            task.cancel()
        # a request still arriving (a slow upload) is refused now, not at uvicorn's backstop
        receiving, self._receiving = list(self._receiving.values()), {}
        for task in receiving:
            task.cancel()
        return len(open_now) + len(receiving)

    def _on_engine_change(self, engine_id: str, what: str) -> None:
        """An engine marked stalled: its migratable streams waiting on it are resumed elsewhere
        now, not after idle_timeout_s of silence each, and the requests waiting on it with nothing
        of their answer sent yet that may go elsewhere (:func:`policies.stall.may_try_elsewhere`)
        are tried on another engine now, not after first_token_timeout_s or request_timeout_s
        (``stall_after_s`` said it is no slow step but an engine that has stopped)."""
        if what != "role" or engine_id in self._sweeping:
            return  # (the ejection below tells of the engine again)
        record = self.fleet.records.get(engine_id)
        if record is None or not record.stalled:
            return
        self._sweeping.add(engine_id)
        try:
            self._sweep_stalled(record)
        finally:
            self._sweeping.discard(engine_id)

    def _sweep_stalled(self, record: EngineRecord) -> None:
        engine_id = record.engine_id
        after_s = self.settings.stall_after_s
        counts_steps = record.counts_steps(time.monotonic(), after_s)
        prefill = self.slo.coefficients(engine_id)[0]
        outliers = self.flow.collocated.outliers
        streams: list[StreamLedger] = []
        waiting: list[Call] = []
        for call, _ in self._open.values():
            if call.engine_id == engine_id and call.ledger is not None and call.first_at:
                if call.ledger.tracking:  # (one that cannot migrate keeps its idle limit)
                    streams.append(call.ledger)
            elif (
                call.engine_wait is not None
                and call.wait_engine == engine_id
                and may_try_elsewhere(
                    stream=call.wait_streamed,
                    engine_counts_steps=counts_steps,
                    pinned=call.pinned is not None,
                    cut_before=call.stall_cuts > 0,
                    predicted_prefill_s=predict_prefill(prefill, (call.request.prompt_tokens,)),
                    after_s=after_s,
                )
            ):
                waiting.append(call)
        if not streams and not waiting:
            return
        # its work gone, it would hold nothing and be back in rotation at the next check, emptier
        # than any, while it is still hung: it stays out for an ejection's time. Kept in rotation
        # (ejections off, or its pool's share out), what it holds stays: emptied, it would take
        # new requests and hold each for stall_after_s again
        outliers.eject(engine_id, "stalled with requests on it")
        if not record.tripped:
            return
        resumed = sum(ledger.cut_for_stall() for ledger in streams)
        retried = sum(call.cut_stalled_wait() for call in waiting)
        if resumed or retried:
            message = "engine %s stalled: %d streams resumed, %d requests tried elsewhere"
            log.warning(message, engine_id, resumed, retried)

    def _parse_tokenizers(self) -> Mapping[str, str] | None:
        """What the parsing worker keys prompts with, by the body's ``model`` (an adapter's
        prompts with its base model's engine tokenizer); None: the parser's own."""
        directories = self.keyer.directories
        bases = self.fleet.adapter_bases
        if not directories or not bases:
            return None
        if self._tokenizers_for is not bases:
            self._tokenizers_for = bases
            adapters = {a: directories[b] for a, b in bases.items() if b in directories}
            self._tokenizers = {**adapters, **directories} if adapters else None
        return self._tokenizers

    def _new_id(self) -> str:
        return f"sg-{self._boot}-{next(self._ids):x}"

    async def handle(self, kind: RouteKind, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        headers: dict[bytes, bytes] = dict(scope["headers"])
        rid = self._new_id()
        given = headers.get(b"x-request-id")
        client_rid = given if given is not None and _CLIENT_ID.fullmatch(given) else rid.encode()
        log_extra = {"request_id": client_rid.decode(), "gateway_request_id": rid}
        model = "-"
        slo_class = "-"
        status = 500
        call: Call | None = None
        body_s = 0.0  # receiving the body is the client's time, not the gateway's
        #: the overhead of an answer sent before the request had a Call (which otherwise holds it)
        early_overhead_s = -1.0
        error_code: str | None = None
        tracing = self.flow.tracing
        # wall-clock start of the request span, read only with tracing on (off reads no clock)
        span_start = now_ns() if tracing.tracer is not None else 0
        span: Span | None = None
        lease = self.bodies.lease()
        watchdog = Watchdog()
        handler = watchdog.task
        self._receiving[rid] = handler
        served = False
        try:
            identity = self.auth.client(headers)
            # The span starts once the caller is authenticated: an anonymous caller makes no span
            # work, and its traceparent's sampled flag cannot override tracing_sample_ratio.
            if tracing.tracer is not None:
                span = tracing.start_request(kind, scope["path"], headers, span_start)
            policy = identity.policy
            if scope["method"] != "POST":
                refused = GatewayError(405, f"{scope['path']} accepts POST only", code="method_not_allowed")
                refused.extra_headers = ((b"allow", b"POST"),)
                raise refused
            encoding = headers.get(b"content-encoding")
            if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
                # (read as JSON, a gzip body was "not valid UTF-8")
                raise GatewayError(
                    415,
                    "request bodies are read as they come: a compressed body (Content-Encoding "
                    f"{encoding.decode(errors='replace')[:40]!r}) is not supported",
                    code="unsupported_media_type",
                )
            declared = headers.get(b"content-length")
            if declared is not None and declared.startswith(b"0"):
                # (HTTP allows leading zeros: 20 digits of them were a 413)
                declared = declared.lstrip(b"0") or b"0"
            limit = self.settings.max_body_bytes
            if declared is not None and declared.isdigit() and (len(declared) > 19 or int(declared) > limit):
                raise GatewayError(
                    413,
                    f"request body exceeds {self.settings.max_body_bytes} bytes",
                    code="request_too_large",
                )
            if declared is not None and declared.isdigit():
                lease.admit(int(declared))
            started = time.monotonic()
            try:
                # a client that declares a body and stops sending it would hold the handler and its
                # connection for good (uvicorn bounds no body read)
                async with time_limit(watchdog, self.settings.body_timeout_s):
                    raw = await read_body(receive, self.settings.max_body_bytes, lease)
            except TimeoutError:
                error = GatewayError(
                    408,
                    f"the request body did not arrive within {self.settings.body_timeout_s:g} s",
                    code="request_timeout",
                )
                # the rest of the body would be read as the connection's next request
                error.extra_headers = ((b"connection", b"close"),)
                raise error from None
            finally:
                # also when the body is refused partway (a 413): the upload was the client's time
                body_s = time.monotonic() - started
            request = await self.parser.parse(kind, raw, self._parse_tokenizers())
            if request.model not in self.fleet.served_models:
                # a LoRA adapter some engine has loaded: routed, queued and counted by its base
                # model; the body still names the adapter, which is what the engine serves
                base = self.fleet.adapter_base(request.model)
                if base is not None:
                    request.lora, request.model = request.model, base
                    model = base  # (a refusal just below is counted under it)
                    if (
                        self.router is not None
                        and self.router.lora.required
                        and not self.fleet.adapter_in_rotation(request.lora)
                    ):
                        # every engine that has it loaded is out of rotation: an engine without it
                        # would answer 404 "does not exist", which clients take as final
                        raise no_healthy_engine(
                            base, f"no healthy engine has LoRA adapter {request.lora!r} loaded"
                        )
            # label by served model only, so arbitrary client strings cannot grow the metric set
            model = request.model if request.model in self.fleet.served_models else "(unknown)"
            target, priority = self.slo.classify(
                headers, request.priority, policy, request.model, request.model in self.fleet.served_models
            )
            slo_class = target.slo_class
            if request.model not in self.fleet.served_models:
                # refused here, before its prompt is keyed (a bad SLO header still says so
                # first): hashing 200 KB for a model nobody serves is loop time spent on nothing
                raise model_not_found(request.model, self.fleet.served_models)
            reply = (
                (b"x-request-id", client_rid),
                (b"x-slo-class", target.slo_class.encode()),
                (b"x-slo-ttft-ms", b"%d" % round(target.ttft_s * 1000)),
                (b"x-slo-tpot-ms", b"%d" % round(target.tpot_s * 1000)),
            )
            call = Call(
                request,
                rid,
                client_rid.decode(),
                arrival,
                send,
                target,
                priority,
                reply,
                forwardable_headers(scope["headers"]),
                queue_priority=priority if priority is not None else policy.max_priority or 0,
                tenant=identity.tenant or "default",
                slo_batch=header_text(headers, b"x-slo-batch"),
                waited_s=body_s,
                span=span,
                watchdog=watchdog,
            )
            if self.prefix is not None:
                await self._attach(call, headers)
            if (
                self.router is not None
                and identity.policy.decisions
                and headers.get(b"x-slogate-debug") in _DEBUG_ON
            ):
                self.router.explain(rid, _decision_receiver(call))
            if request.kind == "responses":
                await self.responses.pin(call, call.tenant)
            self._receiving.pop(rid, None)  # (_serve keeps it with what is open)
            served = True
            status = await self._serve(call, receive)
            if request.kind == "responses":
                self.responses.finished(call, status, call.tenant)
        except GatewayError as error:
            self._receiving.pop(rid, None)  # (answering: not a request a cut should end)
            status, early_overhead_s = await self._answer_error(
                send, error, call, arrival, body_s, client_rid, watchdog
            )
            error_code = error.code or str(error.status)
            if error.code == NO_HEALTHY_ENGINE:
                # (here, where the request is answered: not every attempt's, which another may mend)
                metrics.NO_ENGINE.labels(model).inc()
        except asyncio.CancelledError:
            if not self.cut or served:
                raise  # (_serve answers what it serves; nothing else cancels a handler)
            # Stopping while the request was still arriving or being parsed: cut at the grace's
            # end (cut_open) or by uvicorn's backstop. A 503 that says so, not uvicorn's bare
            # 500 and traceback (uvicorn closes the connection after it: it is stopping, so what
            # is left of a body is never read as a next request)
            handler.uncancel()
            refused = _shutting_down()
            status, early_overhead_s = await self._answer_error(
                send, refused, call, arrival, body_s, client_rid, watchdog
            )
            error_code = refused.code
        except ClientGone:
            status = 499
            metrics.CLIENT_DISCONNECTS.inc()
        except Exception:
            # A bug, not a client or engine problem: still an OpenAI-shaped answer, never a bare
            # traceback page. If the response had already started the send fails and the
            # connection is closed, which the client sees as a cut stream.
            self._receiving.pop(rid, None)
            status = 500
            log.exception("internal error", extra=log_extra)
            with contextlib.suppress(Exception):
                internal = GatewayError(500, "internal gateway error; see its log", code="internal_error")
                header, early_overhead_s = self._overhead(call, arrival, body_s)
                extra = ((b"x-request-id", client_rid), header)
                async with asyncio.timeout(_ERROR_SEND_S):  # (a client taking nothing is gone)
                    await send_error(send, internal, extra)
        finally:
            watchdog.close()
            lease.release()
            self._receiving.pop(rid, None)
            if self.prefix is not None:
                self.prefix.detach(rid)
            if self.router is not None:
                self.router.forget(rid)
            metrics.deferred(metrics.REQUESTS, kind, model, slo_class, _status_class(status)).inc()
            if status < 400:
                latency = time.monotonic() - arrival
                metrics.deferred(metrics.REQUEST_LATENCY, model, slo_class).observe(latency)
            outcome = None
            if call is not None:
                self.flow.collocated.outliers.settle(call, status)
                count_usage(call)
                outcome = self.slo.account(call, status)
                _observe(call, kind, model, status)
            elif early_overhead_s >= 0.0:  # every answer's header figure reaches the metric
                metrics.deferred(metrics.OVERHEAD, kind).observe(early_overhead_s)
            if span is not None:
                _end_request_span(span, call, model, status, outcome, error_code)
            if self.settings.log_requests:
                log.info("request done", extra={**log_extra, "model": model, "status": status})

    async def handle_response_item(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: relayed to the engine
        that stored the response (:class:`gateway.serving.responses.Responses`)."""
        status = 500
        rid = self._new_id()
        task = asyncio.current_task()
        assert task is not None
        self._receiving[rid] = task  # (a shutdown's cut ends it: see cut_open)
        try:
            if self.cut:
                raise _shutting_down()
            identity = self.auth.client(dict(scope["headers"]))
            status = await self.responses.handle_item(scope, receive, send, identity.tenant or "default")
        except GatewayError as error:
            status, _ = await self._answer_error(send, error, None, time.monotonic(), 0.0, rid.encode())
        except TimeoutError:  # (a client that took nothing of the answer)
            status = 499
            metrics.CLIENT_DISCONNECTS.inc()
        except asyncio.CancelledError:
            if not self.cut:
                raise
            task.uncancel()
            status, _ = await self._answer_error(
                send, _shutting_down(), None, time.monotonic(), 0.0, rid.encode()
            )
        except Exception:
            log.exception("internal error", extra={"gateway_request_id": rid})
            internal = GatewayError(500, "internal gateway error; see its log", code="internal_error")
            status, _ = await self._answer_error(send, internal, None, time.monotonic(), 0.0, rid.encode())
        finally:
            self._receiving.pop(rid, None)
            metrics.deferred(metrics.REQUESTS, "responses_item", "-", "-", _status_class(status)).inc()

    async def _attach(self, call: Call, headers: dict[bytes, bytes]) -> None:
        """Hand the router the request's prompt blocks (the prefix index's key) and session key:
        ``x-session-id``, else the body's ``user`` (:func:`affinity_key`)."""
        assert self.prefix is not None
        request = call.request
        blocks = None
        if self.prefix.index is not None and request.kind != "embeddings":
            t0 = time.perf_counter()
            if request.parsed is None:  # keyed by the parsing worker
                tokens = request.prompt_ids
            else:
                tokens = await self.keyer.token_ids_async(
                    request.kind, request.body, request.model, len(request.raw)
                )
            blocks = prompt_blocks(request.model, tokens, request.cache_salt, request.lora)
            metrics.PREFIX_HASH.observe(time.perf_counter() - t0)
        key = None
        if self.prefix.affinity is not None:
            key = affinity_key(call.tenant, header_text(headers, b"x-session-id"), request.user)
        self.prefix.attach(call.rid, blocks, key)

    async def _answer_error(
        self,
        send: Send,
        error: GatewayError,
        call: Call | None,
        arrival: float,
        body_s: float,
        client_rid: bytes,
        watchdog: Watchdog | None = None,
    ) -> tuple[int, float]:
        """Send ``error`` as the answer; returns the status to count (499 for a client that took
        not even that) and the overhead the answer stated when the request had no Call yet."""
        status = error.status
        header, early_overhead_s = self._overhead(call, arrival, body_s)
        extra = ((b"x-request-id", client_rid), header)
        try:
            async with time_limit(watchdog, _ERROR_SEND_S):
                await send_error(send, error, extra)
        except (OSError, RuntimeError):
            pass
        except TimeoutError:  # a client that takes not even an error answer is gone
            status = 499
            metrics.CLIENT_DISCONNECTS.inc()
        return status, early_overhead_s

    @staticmethod
    def _overhead(call: Call | None, arrival: float, body_s: float) -> tuple[tuple[bytes, bytes], float]:
        """The overhead header of an error answer, and the seconds it states when the request has
        no Call yet (-1 otherwise: the Call's ``overhead_s`` holds them)."""
        if call is not None:
            if call.overhead_s >= 0.0:
                # headers already went out with their figure (an error after the response
                # started): that figure stands, the time since is not the gateway's own
                return (OVERHEAD_HEADER, b"%.3f" % (call.overhead_s * 1000.0)), -1.0
            return overhead_header(call, time.monotonic()), -1.0
        own = max(0.0, time.monotonic() - arrival - body_s)
        return (OVERHEAD_HEADER, b"%.3f" % (own * 1000.0)), own

    async def _serve(self, call: Call, receive: Receive) -> int:
        if self.cut:
            raise _shutting_down()
        relay = asyncio.current_task()
        assert relay is not None
        watcher = asyncio.create_task(_watch_disconnect(receive, relay))
        call.watcher = watcher
        self._open[call.rid] = (call, relay)
        self.slo.started(call.priority)
        try:
            return await self.flow.serve(call)
        except GatewayError as error:
            if not (call.started and call.request.stream):
                raise
            # the headers went out with an attempt cut for its engine's stall before its first
            # event, and no later attempt could answer: the client is told in the stream
            if error.code == NO_HEALTHY_ENGINE:
                metrics.NO_ENGINE.labels(call.request.model).inc()
            await end_with_error(call, error)
            return error.status
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled() and watcher.result():
                relay.uncancel()
                raise ClientGone() from None
            if not self.cut:
                raise
            # Stopping, not a client that left: the cut (cut_open) or, after it, the server's
            # backstop. What was open is cleaned up by now, as for a disconnect, and the client
            # is told why it ends wherever it still can be
            relay.uncancel()
            if call.finished_at or (call.started and not call.request.stream):
                # its last bytes not taken within the grace, or a plain answer half sent (no
                # place for an error in it): its connection is closed
                raise ClientGone() from None
            if call.started:
                await end_with_error(call, _shutting_down())
                return 503
            # (a refusal: a 503 with Retry-After; also for an answer whose start was cut while
            # it waited for the socket to drain, and never went out)
            raise _shutting_down() from None
        finally:
            self._open.pop(call.rid, None)
            watcher.cancel()
            self.slo.left(call.priority)


def _shutting_down() -> GatewayError:
    # (a new one for each request: a raised error's traceback would hold every request's frames)
    return GatewayError(
        503, "the gateway is shutting down; retry the request", code="shutting_down", retry_after_s=1.0
    )


#: ``x-slogate-debug`` values that ask for the routing decision in ``x-slogate-decision``
_DEBUG_ON = (b"1", b"true", b"yes")
DECISION_HEADER = b"x-slogate-decision"


def _decision_receiver(call: Call) -> Callable[[Decision], None]:
    def receive(decision: Decision) -> None:
        # a retry decides again: its decision replaces the one before
        kept = tuple(h for h in call.reply_headers if h[0] != DECISION_HEADER)
        call.reply_headers = (*kept, (DECISION_HEADER, decision.header()))
        call.decision = decision

    return receive


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


def _observe(call: Call, route: str, model: str, status: int) -> None:
    """Per-request histograms that need the whole request: once per request, never per token
    (deferred, as every per-request series: folded in when the registry is collected)."""
    if call.overhead_s >= 0.0:
        metrics.deferred(metrics.OVERHEAD, route).observe(call.overhead_s)
    tpot = call.tpot_s if status == 200 else None
    if tpot is not None:
        metrics.deferred(metrics.TPOT, model, call.target.slo_class).observe(tpot)


def _end_request_span(
    span: Span, call: Call | None, model: str, status: int, outcome: str | None, error_code: str | None
) -> None:
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("gen_ai.request.model", model)
    if call is not None:
        target = call.target
        attributes: dict[str, Any] = {
            "slogate.request_id": call.client_rid,
            "slogate.gateway_request_id": call.rid,
            "slogate.slo_class": target.slo_class,
            "slogate.slo.ttft_ms": round(target.ttft_s * 1000.0, 3),
            "slogate.slo.tpot_ms": round(target.tpot_s * 1000.0, 3),
            "slogate.stream": call.request.stream,
            "slogate.tenant": call.tenant,
        }
        if call.priority is not None:
            attributes["slogate.priority"] = call.priority
        if outcome is not None:
            attributes["slogate.slo.outcome"] = outcome
        if call.engine_id is not None:
            attributes["slogate.engine"] = call.engine_id
        if call.overhead_s >= 0.0:
            attributes["slogate.overhead_ms"] = round(call.overhead_s * 1000.0, 3)
        if call.first_at:
            attributes["slogate.ttft_ms"] = round((call.first_at - call.arrival) * 1000.0, 3)
        if call.completion_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = call.completion_tokens
        span.set_attributes(attributes)
    if status >= 500:  # a server error fails the span; a client's mistake or a shed only names it
        fail(span, error_code, status)
    elif error_code is not None:
        span.set_attribute("error.type", error_code)
    elif status == 499:
        span.set_attribute("error.type", "client_disconnected")
    span.end()
