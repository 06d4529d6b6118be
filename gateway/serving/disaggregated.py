"""The disaggregated flow: a prefill engine computes the prompt's KV, a decode engine streams.

Two-stage placement (HyperFlexis §5.1): the prefill goes through the admission queue and the
dispatcher like any request (the front pool of a P/D model is its prefill engines); the decode
engine is chosen only when the prefill has finished, with the fleet as it is at that moment
(:func:`policies.decode_placement.place_decode`: TPOT slack after the request joins, KV room,
transfers already arriving on the engine's link). Peer gateways fix the pair at arrival.

Protocols, by the prefill engine's ``kv_transfer`` (docs/pd.md); ``shared`` (a KV store both
engines read by prefix: vLLM's ExampleConnector, LMCache) runs as ``nixl`` without the params:

* ``nixl`` (vLLM): the prefill is sent alone with ``kv_transfer_params.do_remote_decode``,
  ``max_tokens`` 1, no stream (``stream_options`` and ``min_tokens`` removed); the
  ``kv_transfer_params`` it answers go verbatim into the decode request, which carries the
  client's own body otherwise. The engines move the KV between them.
* ``bootstrap`` (SGLang): bootstrap host, port and a random room go into both bodies and both are
  sent together, so the decode engine is placed when the prefill is (the protocol needs the pair
  up front). If the prefill fails before the decode has answered anything, the decode request
  is closed at once rather than left waiting for KV that will not come (aibrix#2289, #2746).

Which requests go through the prefill pool (:func:`policies.disaggregation.decide_disaggregation`):
``always``, ``never``, or ``conditional`` (short prompts run whole on a decode engine). A
prefill that fails on every attempt, or a model whose prefill engines are all out, falls back to
running the request whole on a decode engine, except under ``always``, which never prefills on a
decode engine and answers the error instead (llm-d#2427).

The client sees one response; ``x-slogate-prefill-engine`` names the prefill engine and
``x-slogate-engine`` the decode engine. Each engine's capacity is reserved while it works on the
request and released when its part ends (the prefill's when its answer arrives).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.dispatch.core import no_healthy_engine
from gateway.dispatch.profile import DispatcherConfig
from gateway.dispatch.slo_service import SloService
from gateway.dispatch.transfer_gate import TransferGate
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry, alone_since
from gateway.serving.call import Call
from gateway.serving.collocated import (
    OVERLOADED,
    PATHS,
    REQUEST_TIMEOUT,
    CollocatedFlow,
    end_upstream,
    out_of_time,
)
from gateway.serving.relay import end_with_error, stalled_error
from gateway.serving.watchdog import time_limit_at
from gateway.tasks import cancel_and_wait
from gateway.tracing import SPAN_DISPATCH, Span, Tracing
from policies.api import EngineSnapshot, Role
from policies.decode_placement import DecodeCandidate, DecodeChoice, DecodeDemand, place_decode
from policies.disaggregation import DisaggregationMode, decide_disaggregation
from policies.migration import more_than_one
from policies.transfer_order import LinkParams, TransferRequest, make_transfer_order

log = logging.getLogger("slogate.serving.pd")

PREFILL_ENGINE_HEADER = b"x-slogate-prefill-engine"
#: what a vLLM prefill request carries (NIXL connector; the decode gets the prefill's answer)
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: fields a prefill engine does not take (vLLM's P/D proxy removes them, the decode keeps them)
PREFILL_REMOVES = ("stream_options", "min_tokens", "min_completion_tokens")
#: a KV transfer's turn lasts at least this long without a first token (see _transfer_turn)
_MIN_TRANSFER_TURN_S = 0.05


class _TransferWaitOver(Exception):
    """The wait for a KV transfer's turn ran out: the request's own time (``deadline``), or the
    prefill's KV lease."""

    def __init__(self, deadline: bool) -> None:
        super().__init__("the wait for a KV transfer's turn ran out")
        self.deadline = deadline


#: the longest a prefilled request waits for its KV transfer's turn: the prefill engine keeps the
#: KV for a lease (vLLM's kv_lease_duration, 30 s by default), and a decode engine told to read it
#: after that finds it freed
TRANSFER_WAIT_LIMIT_S = 20.0


@dataclass(slots=True)
class _Progress:
    """One disaggregated request's progress across the placement loop's attempts."""

    #: a prefill finished: later failures are the decode's, which no fallback repeats
    prefilled: bool = False
    #: an attempt ended as the collocated flow never retries (an engine that had the request
    #: timed out): no fallback repeats it on a decode engine either
    final: bool = False
    decode_tried: list[str] = field(default_factory=list)


def _path(progress: _Progress, status: int | None) -> str:
    """What the request's placement loop came to, for ``slogate_pd_requests_total``: through a
    prefill engine, whole on a collocated engine of the front pool, or no answer before either
    (``status`` None: it raised; an error status: a stream ended with an error event)."""
    if progress.prefilled:
        return "disaggregated"
    return "failed" if status is None or status >= 400 else "collocated"


class DisaggregatedFlow:
    """Serves every request: models with prefill engines two-stage, the rest collocated."""

    def __init__(
        self, fleet: Fleet, collocated: CollocatedFlow, slo: SloService, config: DispatcherConfig
    ) -> None:
        self.fleet = fleet
        self.collocated = collocated
        self.slo = slo
        self.tracing: Tracing = collocated.tracing
        self.settings = collocated.settings
        self.params = config.disaggregation
        self.placement = config.decode_placement
        #: per decode engine, decode stages whose KV is (predicted to be) still arriving
        self._arriving: dict[str, int] = {}
        #: orders KV transfers into each decode engine (None: decode requests go at once)
        self.gate: TransferGate | None = None
        gating = config.kv_transfer
        if gating is not None:
            link = LinkParams(config.decode_placement.transfer_tokens_per_s)
            order = make_transfer_order(gating.order, link, gating.levels)
            self.gate = TransferGate(order, gating.max_per_engine, time.monotonic)
        if collocated.migration is not None:
            collocated.migration.decode_placer = self._place_continuation

    async def serve(self, call: Call) -> int:
        request = call.request
        model = request.model
        if not self.fleet.has_prefill_pool(model):
            return await self.collocated.serve(call)
        always = self.params.mode is DisaggregationMode.ALWAYS
        body_n = request.body.get("n") if request.parsed is not None or "n" in request.keys else None
        several = more_than_one(body_n)
        # a completions batch (several prompts) is several sequences too: vLLM answers its prefill
        # with the first prompt's kv_transfer_params only, and a bootstrap room is one sequence's
        batch = request.prompts > 1
        if (several or batch) and always:
            # the handovers carry one sequence's KV; 'always' forbids running it whole on a decode engine
            what, param = ("n = 1", "n") if several else ("one prompt per request", "prompt")
            metrics.child(metrics.PD_REQUESTS, model, "failed").inc()
            raise GatewayError(
                400,
                f"model {model!r} is served disaggregated only (mode always), which takes {what}",
                param=param,
                code="n_not_supported" if several else "batch_not_supported",
            )
        several = several or batch
        if request.kind == "responses":
            # a Responses request is not handed over between engines (its answer is the engine's
            # own typed events, its conversation stored where it ran): whole on a decode engine,
            # which 'always' forbids
            if always:
                metrics.child(metrics.PD_REQUESTS, model, "failed").inc()
                raise GatewayError(
                    400,
                    f"model {model!r} is served disaggregated only (mode always), which the "
                    "Responses API is not: use /v1/chat/completions",
                    param="model",
                    code="model_not_supported",
                )
            metrics.child(metrics.PD_REQUESTS, model, "whole_on_decode").inc()
            return await self._whole_on_decode(call, None)
        if request.kind == "embeddings" and always:
            # an embedding is a prefill and nothing else: whole on the front pool (a prefill
            # engine), as 'always' keeps every prompt off the decode engines
            metrics.child(metrics.PD_REQUESTS, model, "whole_on_prefill").inc()
            return await self.collocated.serve(call)
        if request.kind == "embeddings" or several:
            metrics.child(metrics.PD_REQUESTS, model, "whole_on_decode").inc()
            return await self._whole_on_decode(call, None)
        if not decide_disaggregation(request.prompt_tokens, None, self.params).disaggregate:
            metrics.child(metrics.PD_REQUESTS, model, "whole_on_decode").inc()
            return await self._whole_on_decode(call, None)
        if not self.fleet.decode_pool(model):
            metrics.child(metrics.PD_REQUESTS, model, "failed").inc()
            raise self._no_decode_engine(model)  # a prefill now would only strand its KV
        refused = self._decode_refusal(call)
        if refused is not None:
            metrics.child(metrics.PD_REQUESTS, model, "failed").inc()
            raise refused
        if not always and not self.fleet.has_healthy(model):
            # no prefill engine in rotation: whole on a decode engine at once (a prefill attempt
            # would only fail first, and count the request as refused for want of an engine)
            metrics.child(metrics.PD_REQUESTS, model, "fallback").inc()
            _prefill_engine_header(call, None)
            return await self._whole_on_decode(call, None)
        progress = _Progress()

        async def stage(
            call: Call, record: EngineRecord, entry: RunningEntry, deadline: float | None
        ) -> int | GatewayError:
            return await self._stage(progress, call, record, entry, deadline)

        try:
            status = await self.collocated.serve(call, stage)
        except GatewayError as error:
            if (
                always
                or progress.prefilled
                or progress.final
                or not 500 <= error.status < 600
                or error.code in (OVERLOADED, REQUEST_TIMEOUT)
            ):
                # (the gateway out of sockets: a decode engine would need one as well; the
                # request's time is over: a decode engine would have none for it)
                metrics.child(metrics.PD_REQUESTS, model, _path(progress, None)).inc()
                raise
            # every prefill attempt failed (or no prefill engine is in rotation): the request
            # runs whole on a decode engine, which can prefill too
            log.warning(
                "prefill failed (%s); serving whole on a decode engine",
                error.code or error.status,
                extra={"request_id": call.client_rid},
            )
            metrics.child(metrics.PD_REQUESTS, model, "fallback").inc()
            _prefill_engine_header(call, None)
            return await self._whole_on_decode(call, error)
        except BaseException:  # (the client left, or the gateway stops: counted all the same)
            cancelled = "disaggregated" if progress.prefilled else "cancelled"
            metrics.child(metrics.PD_REQUESTS, model, cancelled).inc()
            raise
        metrics.child(metrics.PD_REQUESTS, model, _path(progress, status)).inc()
        return status

    # -- the prefill engine's part ------------------------------------------------------------------

    async def _stage(
        self,
        progress: _Progress,
        call: Call,
        record: EngineRecord,
        entry: RunningEntry,
        deadline: float | None,
    ) -> int | GatewayError:
        """One placement from the front pool: a collocated engine serves whole; a prefill
        engine prefills, then the decode stage runs."""
        _prefill_engine_header(call, None)  # (an earlier attempt's)
        if record.adapter.role is not Role.PREFILL:
            try:
                return await self.collocated.attempt(call, record, entry, deadline)
            except GatewayError:
                progress.final = True  # (it raises only what is never retried: see attempt)
                raise
        if record.adapter.config.transfer_protocol == "bootstrap":
            return await self._bootstrap(progress, call, record, entry, deadline)
        shared = record.adapter.config.transfer_protocol == "shared"
        kv = await self._prefill_first(call, record, entry, deadline, shared)
        self.collocated.dispatch.release(record.engine_id, call.rid)  # its part is over
        if isinstance(kv, GatewayError):
            return kv
        progress.prefilled = True
        overrides: dict[str, object] = {} if shared else {"kv_transfer_params": kv}
        outcome = await self._decode_stage(progress, call, record, deadline, overrides, entry.late)
        if isinstance(outcome, GatewayError):
            # the prefill is done: another one would only be the same work again (and strand
            # this one's KV): the decode stage's failure is the answer
            raise outcome
        return outcome

    async def _prefill_first(
        self, call: Call, record: EngineRecord, entry: RunningEntry, deadline: float | None, shared: bool
    ) -> dict[str, object] | GatewayError:
        """Run the prefill alone; its ``kv_transfer_params`` (empty for a shared KV store, where
        the decode engine finds the KV by prefix), or a retryable error."""
        overrides: dict[str, object] = {"stream": False, "max_tokens": 1}
        if not shared:
            overrides["kv_transfer_params"] = NIXL_PREFILL_PARAMS
        if call.request.kind == "chat":
            overrides["max_completion_tokens"] = 1
        payload = self.collocated.body_for(call, record, overrides, PREFILL_REMOVES, late=entry.late)
        body = await self._prefill_exchange(call, record, entry, payload, deadline, count_wait=True)
        if isinstance(body, GatewayError):
            return body
        if shared:
            return {}
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            answer = None
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):
            metrics.child(metrics.UPSTREAM_ERRORS, record.engine_id, "protocol").inc()
            return GatewayError(
                502,
                f"prefill engine {record.engine_id} answered without kv_transfer_params "
                "(is it running with a KV connector?)",
                code="upstream_failed",
            )
        return kv

    async def _prefill_exchange(
        self,
        call: Call,
        record: EngineRecord,
        entry: RunningEntry,
        payload: bytes,
        deadline: float | None,
        count_wait: bool,
    ) -> bytes | GatewayError:
        """POST a prefill and read its whole answer within the first-token limit (the prefill is
        the request's time to first token); failures and timeouts are retryable: the client has
        seen nothing, and closing the response aborts the engine's request."""
        settings = self.settings
        collocated = self.collocated
        engine_id = record.engine_id
        url = record.adapter.url(PATHS[call.request.kind])
        headers = collocated.headers_for(call, record)
        loop = asyncio.get_running_loop()
        finish_at = loop.time() + settings.first_token_timeout_s
        if deadline is not None:
            finish_at = min(finish_at, loop.time() + (deadline - time.monotonic()))
        entry.dispatched_at = time.monotonic()
        entry.alone_since = alone_since(record)
        call.stall_cut = False  # (a cut of the last prefill's wait is not this one's)
        if not call.prefill_dispatched_at:
            call.prefill_dispatched_at = entry.dispatched_at
        metrics.deferred(metrics.DISPATCHES, engine_id).inc()
        up = collocated.upstream_span(call, record, url, headers) if call.span is not None else None
        outcome: bytes | GatewayError | BaseException = GatewayError(502, "prefill did not run")
        try:
            outcome = await self._prefill_read(call, record, url, payload, headers, finish_at, count_wait, up)
            # (the prefill engine judged as a whole request's: an answer, or a retryable failure)
            collocated.outliers.judge(engine_id, 200 if isinstance(outcome, bytes) else outcome, call)
            if isinstance(outcome, bytes):
                self.fleet.mark_prefilled(engine_id, call.rid)
                # (a bootstrap prefill answers once its KV has reached the decode engine: its time
                # is not the prefill's)
                timed = record.adapter.config.transfer_protocol != "bootstrap"
                self.slo.latency.prefill_answered(record, entry, timed)
            return outcome
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            if up is not None:
                _end_prefill_span(up, call, outcome)

    async def _prefill_read(
        self,
        call: Call,
        record: EngineRecord,
        url: str,
        payload: bytes,
        headers: dict[str, str],
        finish_at: float,
        count_wait: bool,
        up: Span | None,
    ) -> bytes | GatewayError:
        engine_id = record.engine_id
        try:
            # (cut when the prefill engine is marked stalled: retried elsewhere, as a timeout is)
            response = await self.collocated.post(
                call, record, url, payload, headers, finish_at, count_wait, cuttable=True
            )
        except GatewayError as error:
            if error.code != "upstream_timeout":
                raise
            return error  # a prefill that timed out is retried elsewhere (this one is aborted)
        if isinstance(response, GatewayError):
            return response
        if up is not None:
            up.set_attribute("http.response.status_code", response.status)
        try:
            if response.status != 200:  # (any other status is no answer: engine_refused)
                return await self.collocated.engine_refused(call, record, response, finish_at, count_wait)
            started = time.monotonic()  # (post counted the wait for the headers)
            try:
                async with time_limit_at(call.watchdog, finish_at) as limit:
                    # (the same wait on the engine as its headers': a cut made as they came holds)
                    call.wait_on_engine(limit, engine_id, call.request.stream)
                    return await response.read()
            except TimeoutError:
                if call.stall_cut:
                    return stalled_error(engine_id)
                metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
                return GatewayError(
                    504, f"prefill engine {engine_id} did not finish in time", code="upstream_timeout"
                )
            except aiohttp.ClientError as exc:
                metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
                return GatewayError(
                    502, f"prefill engine {engine_id} failed: {exc!r}", code="upstream_failed"
                )
            finally:
                call.engine_wait = None
                if count_wait:
                    call.waited_s += time.monotonic() - started  # the engine computing the prefill
        finally:
            response.close()

    # -- the decode stage ---------------------------------------------------------------------------

    def place_decode(
        self,
        call: Call,
        source: str | None,
        exclude: list[str],
        context_tokens: int | None = None,
        remaining_tokens: int | None = None,
    ) -> DecodeChoice | None:
        """The decode engine for ``call`` now (None: no decode engine in rotation); a migrated
        stream's continuation gives its context (prompt and tokens so far) and tokens left."""
        fleet = self.fleet
        candidates = []
        pool: Sequence[EngineSnapshot] = fleet.decode_pool(call.request.model)
        if call.request.lora is not None:  # (a LoRA adapter's request: engines that have it)
            pool = self.collocated.dispatch.core.router.with_lora(call.request.lora, pool)
        if call.pinned is not None:  # (a Responses continuation: the engine that stored it only)
            pool = [snap for snap in pool if snap.engine_id == call.pinned]
        context = call.request.prompt_tokens if context_tokens is None else context_tokens
        judged = self.slo.decode_judged([s.engine_id for s in pool], context)
        for snap in pool:
            if snap.engine_id in exclude:
                continue
            record = fleet.records[snap.engine_id]
            candidates.append(
                DecodeCandidate(
                    snap,
                    judged[snap.engine_id],
                    transfers_in_flight=self._arriving.get(snap.engine_id, 0),
                    free_kv_tokens=record.free_kv_tokens(),
                    tightest_running_tpot_s=record.tightest_tpot(),
                )
            )
        request = call.request
        demand = DecodeDemand(
            call.rid,
            request.prompt_tokens if context_tokens is None else context_tokens,
            request.max_tokens if remaining_tokens is None else remaining_tokens,
            call.target.tpot_s,
            source,
        )
        choice = place_decode(demand, candidates, self.placement)
        metrics.child(
            metrics.PD_DECODE_PLACEMENTS,
            "none" if choice is None else "feasible" if choice.feasible else "best_effort",
        ).inc()
        if call.span is not None:
            self._decode_span(call, choice, len(candidates))
        return choice

    def _decode_decided(self, call: Call, engine_id: str, tried: Sequence[str]) -> None:
        """A decode placement in /dashboard's decision log, as every placement is (its span is
        :meth:`place_decode`'s)."""
        self.collocated.log_decision(call, len(tried) + 1, engine_id, None, 0.0, tried)

    def _decode_span(self, call: Call, choice: DecodeChoice | None, candidates: int) -> None:
        assert call.span is not None
        attributes: dict[str, object] = {"slogate.stage": "decode", "slogate.decode.candidates": candidates}
        if choice is not None:
            attributes["slogate.engine"] = choice.engine_id
            attributes["slogate.decode.feasible"] = choice.feasible
            attributes["slogate.decode.predicted_tpot_ms"] = round(choice.predicted_tpot_s * 1000, 3)
            attributes["slogate.decode.predicted_transfer_ms"] = round(choice.predicted_transfer_s * 1000, 3)
        span = self.tracing.child(call.span, SPAN_DISPATCH, attributes)
        span.end()

    def _decode_refusal(self, call: Call) -> GatewayError | None:
        """What every decode engine would refuse the request for, known before its prefill: the
        prefill is sent with max_tokens 1 and without min_tokens, so it succeeds, and the decode
        engine's 400 then left the prefill's KV held for its whole lease (30 s in vLLM)."""
        request = call.request
        body = request.body
        bound = _count_field(body, "max_tokens")
        if request.kind == "chat":  # (max_completion_tokens is chat's, and wins: completions ignore it)
            bound = _count_field(body, "max_completion_tokens") or bound
        least = _count_field(body, "min_tokens")
        if bound is not None and least is not None and least > bound:
            return GatewayError(
                400,
                f"min_tokens={least} must be at most max_tokens={bound}",
                param="min_tokens",
                code="invalid_request",
            )
        fleet = self.fleet
        engines = fleet.engines_of.get(request.model, ())
        if any(r.adapter.role is Role.COLLOCATED and fleet.in_front(r) for r in engines):
            return None  # (a collocated engine of the front pool may serve it whole, on its own context)
        contexts = [
            length
            for snap in fleet.decode_pool(request.model)
            if (length := fleet.records[snap.engine_id].max_model_len) is not None
        ]
        if bound is not None and contexts and bound > max(contexts):
            return GatewayError(
                400,
                f"max_tokens={bound} cannot be greater than max_model_len={max(contexts)}",
                param="max_tokens",
                code="invalid_request",
            )
        return None

    def _no_decode_engine(self, model: str) -> GatewayError:
        """The 503 for a model with no decode engine in rotation."""
        return no_healthy_engine(model, f"no decode engine of model {model!r} is in rotation")

    def routable(self, model: str) -> bool:
        """Whether requests for ``model`` can be served now: a collocated or prefill engine in
        rotation, or for a model served disaggregated, a decode engine and (unless the mode is
        ``always``, which never runs a request whole on a decode engine) a prefill engine."""
        if not self.fleet.has_prefill_pool(model):
            return self.fleet.has_healthy(model)
        if not self.fleet.decode_pool(model):
            return False
        return self.fleet.has_healthy(model) or self.params.mode is not DisaggregationMode.ALWAYS

    async def _decode_stage(
        self,
        progress: _Progress,
        call: Call,
        prefill: EngineRecord,
        deadline: float | None,
        overrides: dict[str, object],
        late: bool = False,
    ) -> int | GatewayError:
        """Place the decode now and run it; another decode engine if one refuses it (cannot be
        reached, or answers an error status): the prefill engine keeps the KV for its lease.
        Not when the request may have reached the engine unanswered (its connection cut once
        written, a late or malformed answer): that engine may have read the KV, and another one
        given the same handover would find none (a non-streamed request then got that engine's
        400 "no KV held", blamed on the client). ``late``: the prefill's mark."""
        _prefill_engine_header(call, prefill.engine_id)
        outcome: int | GatewayError = self._no_decode_engine(call.request.model)
        # the prefill just answered: its KV is held from now on, whichever decode engine reads it
        kv_until = time.monotonic() + TRANSFER_WAIT_LIMIT_S
        for _ in range(self.settings.dispatch_attempts):
            choice = self.place_decode(call, prefill.engine_id, progress.decode_tried)
            if choice is None:
                return outcome
            self._decode_decided(call, choice.engine_id, progress.decode_tried)
            progress.decode_tried.append(choice.engine_id)
            record = self.fleet.records[choice.engine_id]
            entry = self._reserve(call, record, remote_kv=True, late=late)
            end_transfer: Callable[[], None] | None = None
            try:
                try:
                    end_transfer = await self._transfer_turn(
                        call, record, entry, choice, deadline=deadline, kv_until=kv_until
                    )
                except _TransferWaitOver as over:
                    if over.deadline:
                        return out_of_time(self.settings.request_timeout_s, "a decode engine")
                    return GatewayError(
                        503,
                        f"the KV transfers into decode engine {record.engine_id} were busy past "
                        f"{TRANSFER_WAIT_LIMIT_S:g} s, longer than the prefill keeps its KV; retry",
                        code="transfer_wait_exceeded",
                        retry_after_s=1.0,
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    # its time ran out waiting for its transfer's turn
                    return out_of_time(self.settings.request_timeout_s, "a decode engine")
                outcome = await self.collocated.attempt(call, record, entry, deadline, overrides)
            finally:
                if end_transfer is not None:
                    end_transfer()
                self.collocated.dispatch.release(record.engine_id, call.rid)
            if isinstance(outcome, int):
                return outcome
            if call.upstream_answered or call.upstream_reached:
                # it began its answer (or may have read the request), so it has read the KV,
                # which the prefill engine may have freed since: another decode engine given the
                # same handover would read nothing
                return outcome
        return outcome

    async def _transfer_turn(
        self,
        call: Call,
        record: EngineRecord,
        entry: RunningEntry,
        choice: DecodeChoice,
        gated: bool = True,
        deadline: float | None = None,
        kv_until: float = math.inf,
    ) -> Callable[[], None]:
        """The request's KV transfer into ``record``: wait for its turn at the gate (if the
        profile gates transfers), count it as arriving there, and return what ends it (idempotent).

        It ends at the decode engine's first token (the KV had to arrive first), or when the
        predicted transfer time has passed twice over, so that a non-streamed answer (which
        shows no first token) or an engine queue does not hold the link's turn for a whole
        generation; at the latest when the decode stage ends (the caller). The wait for the turn
        raises :class:`_TransferWaitOver` past ``deadline`` (monotonic; a non-streamed
        request's) or ``kv_until`` (TRANSFER_WAIT_LIMIT_S after the prefill answered, within its
        KV lease, whatever decode engines were tried since), leaving no trace at the gate."""
        gate = self.gate if gated else None
        engine_id = record.engine_id
        rid = call.rid
        if gate is not None:
            # the KV has to arrive before the TTFT deadline (monotonic, as the gate's clock)
            request = TransferRequest(rid, call.request.prompt_tokens, call.arrival + call.target.ttft_s)
            waited_from = time.monotonic()
            by_deadline = deadline is not None and deadline < kv_until
            limit = (deadline if deadline is not None and by_deadline else kv_until) - waited_from
            try:
                async with asyncio.timeout(max(0.0, limit)):
                    await gate.admit(engine_id, request)
            except TimeoutError:
                raise _TransferWaitOver(by_deadline) from None
            finally:
                call.waited_s += time.monotonic() - waited_from
        arriving = self._arriving
        arriving[engine_id] = arriving.get(engine_id, 0) + 1
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            timer.cancel()
            entry.on_prefilled = None
            left = arriving[engine_id] - 1
            if left:
                arriving[engine_id] = left
            else:
                del arriving[engine_id]
            if gate is not None:
                gate.done(engine_id, rid)

        bound = max(_MIN_TRANSFER_TURN_S, 2.0 * choice.predicted_transfer_s)
        timer = asyncio.get_running_loop().call_later(bound, end)
        entry.on_prefilled = end
        return end

    def _place_continuation(
        self, call: Call, context: int, remaining: int, exclude: list[str], entry: RunningEntry
    ) -> EngineRecord | None:
        """A decode engine for a migrating stream's continuation, ``entry`` reserved on it (the
        migration module's placer for P/D models: the stream stays on the decode pool)."""
        choice = self.place_decode(call, None, exclude, context, remaining)
        if choice is None:
            return None
        record = self.fleet.records[choice.engine_id]
        self.fleet.reserve(record.engine_id, call.rid, entry)
        return record

    def _reserve(
        self, call: Call, record: EngineRecord, remote_kv: bool = False, late: bool = False
    ) -> RunningEntry:
        """A decode stage's reservation; ``late``: its prefill was dispatched with the TTFT lost,
        and the decode engine's queue keeps it in the late lane too."""
        request = call.request
        entry = RunningEntry(request.prompt_tokens, request.max_tokens, call.target.tpot_s, 0.0)
        entry.remote_kv = remote_kv
        entry.late = late
        entry.stream = request.stream  # (a non-streamed decode shows no progress until it ends)
        self.fleet.reserve(record.engine_id, call.rid, entry)
        return entry

    async def _whole_on_decode(self, call: Call, cause: GatewayError | None) -> int:
        """The whole request on decode engines (short prompt, or the prefill pool failed)."""
        model = call.request.model
        deadline = None if call.request.stream else call.arrival + self.settings.request_timeout_s
        tried: list[str] = []
        failure = cause
        for _ in range(self.settings.dispatch_attempts):
            if deadline is not None and time.monotonic() >= deadline:
                # (the prefills' or the last attempt's failure when they took the time)
                raise failure if failure is not None else out_of_time(self.settings.request_timeout_s)
            choice = self.place_decode(call, None, tried)
            if choice is None:
                break
            self._decode_decided(call, choice.engine_id, tried)
            tried.append(choice.engine_id)
            record = self.fleet.records[choice.engine_id]
            entry = self._reserve(call, record)
            try:
                outcome = await self.collocated.attempt(call, record, entry, deadline)
            finally:
                self.collocated.dispatch.release(record.engine_id, call.rid)
            if isinstance(outcome, int):
                return outcome
            failure = outcome
        raise failure if failure is not None else self._no_decode_engine(model)

    # -- SGLang: bootstrap room, both engines at once -----------------------------------------------

    async def _bootstrap(
        self,
        progress: _Progress,
        call: Call,
        prefill: EngineRecord,
        entry: RunningEntry,
        deadline: float | None,
    ) -> int | GatewayError:
        choice = self.place_decode(call, prefill.engine_id, progress.decode_tried)
        if choice is None:
            self.collocated.dispatch.release(prefill.engine_id, call.rid)
            return self._no_decode_engine(call.request.model)  # (another pair may do)
        self._decode_decided(call, choice.engine_id, progress.decode_tried)
        progress.decode_tried.append(choice.engine_id)
        decode = self.fleet.records[choice.engine_id]
        config = prefill.adapter.config
        fields: dict[str, object] = {
            "bootstrap_host": urlsplit(prefill.adapter.url("/")).hostname or "",
            "bootstrap_port": config.kv_bootstrap_port,
            # SGLang's own router draws the room the same way: a random non-negative i64
            "bootstrap_room": random.getrandbits(63),
        }
        prefill_payload = self.collocated.body_for(
            call, prefill, {**fields, "stream": False}, PREFILL_REMOVES, late=entry.late
        )
        _prefill_engine_header(call, prefill.engine_id)
        decode_entry = self._reserve(call, decode, remote_kv=True, late=entry.late)
        # the decode engine can do nothing for it before the prefill answers: its stall clock
        # starts then (a long prefill was taken for a stalled decode engine)
        decode_entry.ready_at = math.inf
        # counted as arriving at the decode engine (not gated: P and D go together here)
        end_transfer = await self._transfer_turn(call, decode, decode_entry, choice, gated=False)
        prefill_task = asyncio.create_task(
            self._prefill_exchange(call, prefill, entry, prefill_payload, deadline, count_wait=False)
        )
        decode_task = asyncio.create_task(
            self.collocated.attempt(call, decode, decode_entry, deadline, fields)
        )
        try:
            await asyncio.wait((prefill_task, decode_task), return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done():
                self.collocated.dispatch.release(prefill.engine_id, call.rid)
                failed = prefill_task.exception()
                # what the exchange answers (rather than raises) another prefill engine may take
                # on, as in the NIXL path: a 404 for an adapter unloaded since, a 503
                retryable = False
                if failed is None:
                    answer = prefill_task.result()
                    failed = answer if isinstance(answer, GatewayError) else None
                    retryable = failed is not None
                decode_entry.ready_at = time.monotonic()
                # the KV arrived if the decode streamed a token, or (not streamed) began its answer
                kv_arrived = bool(call.first_at) if call.request.stream else call.upstream_answered
                if failed is not None and not decode_task.done() and not kv_arrived:
                    # the decode would wait for KV that is not coming: close it now, whether or
                    # not its stream's headers already reached the client
                    started = call.started and call.request.stream
                    await cancel_and_wait(decode_task, report=False)  # (its outcome is the caller's)
                    overloaded = isinstance(failed, GatewayError) and failed.code == OVERLOADED
                    if started and overloaded:
                        assert isinstance(failed, GatewayError)
                        await end_with_error(call, failed)  # (no engine's failure: none is blamed)
                        return failed.status
                    if started:
                        if not isinstance(failed, GatewayError):  # (one was counted where it arose)
                            metrics.child(metrics.UPSTREAM_ERRORS, prefill.engine_id, "stream_cut").inc()
                        await end_with_error(
                            call,
                            GatewayError(
                                502,
                                f"prefill engine {prefill.engine_id} failed: {failed}",
                                code="upstream_failed",
                            ),
                        )
                        return 502
                    # the decode engine did nothing wrong: the next pair may use it again
                    progress.decode_tried.remove(decode.engine_id)
                    if overloaded:
                        raise failed  # (every pair would need a socket the gateway has not got)
                    if isinstance(failed, GatewayError) and (
                        retryable or failed.status >= 500 or failed.status == 429
                    ):
                        return failed
                    raise failed
                progress.prefilled = failed is None
            try:
                outcome = await decode_task
            except GatewayError:
                progress.final = True  # the decode engine had the request (a timeout): not re-run
                raise
            progress.prefilled = progress.prefilled or isinstance(outcome, int)
            if isinstance(outcome, GatewayError):
                # the decode engine refused: its error is the answer (another pair would only
                # prefill again, and this decode engine would be left out of the next choice)
                raise outcome
            return outcome
        finally:
            # Both are cancelled before either is awaited, and the releases run whatever the
            # waiting raises: when the client left, this task is itself being cancelled, and an
            # await here re-raised that at once, leaving the decode running on without an owner
            # and its reservation counted on the engine.
            pending = [task for task in (prefill_task, decode_task) if not task.done()]
            for task in pending:
                task.cancel()
            try:
                if pending:
                    await asyncio.wait(pending)
            finally:
                for task in (prefill_task, decode_task):
                    if task.done() and not task.cancelled():
                        task.exception()  # retrieved: no "never retrieved" warning
                end_transfer()
                self.collocated.dispatch.release(prefill.engine_id, call.rid)
                self.collocated.dispatch.release(decode.engine_id, call.rid)


def _prefill_engine_header(call: Call, engine_id: str | None) -> None:
    """Name ``engine_id`` as the prefill engine in the reply (None: no prefill engine), replacing
    an earlier attempt's; the reply's other headers (the routing decision's) stay."""
    kept = tuple(h for h in call.reply_headers if h[0] != PREFILL_ENGINE_HEADER)
    call.reply_headers = kept if engine_id is None else (*kept, (PREFILL_ENGINE_HEADER, engine_id.encode()))


def _end_prefill_span(span: Span, call: Call, outcome: bytes | GatewayError | BaseException) -> None:
    end_upstream(span, call, 200 if isinstance(outcome, bytes) else outcome)


def _count_field(body: dict[str, Any], name: str) -> int | None:
    """The body's ``name`` when it is a count (an integer, not a boolean), else None."""
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
