"""Decode migration: resume a started stream on another engine with exact token continuity.

The collocated relay hands over a :class:`~gateway.serving.stream_state.Cut` when a stream that
may migrate leaves its engine: the engine failed (the connection was cut, the stream ended before
``[DONE]``, it stalled after its first event) or its TPOT slack stayed negative while another
engine had room (the slack move already reserved that engine). :meth:`Migrator.resume` asks the
pure policy (:mod:`policies.migration`) whether to go on, and if so re-issues the prompt's token
ids plus every output token id relayed so far to another engine through ``/v1/completions`` with
the remaining budget, the way Dynamo migrates (``--migration-limit``): the new engine re-prefills
(its prefix cache helps) and continues exactly where the first one stopped, because the output
is a function of the sequence (greedy decoding, or the simulated engine).

Its chunks are turned into the client's shape (chat ``delta.content`` or completion ``text``)
under the first engine's ``id``, ``created`` and ``model``; the final ``usage`` counts the
client's own prompt and every output token (those relayed before the move plus the new engine's
``completion_tokens``). Only the migrated part is parsed: before a migration the relay stays
byte for byte. Placement goes through :meth:`DispatchLoop.place` with the engines already used
excluded; each reservation is released when that engine's part ends, however it ends.

Not migrated (a clear error event instead): requests :func:`policies.migration.unsupported`
refuses (guided decoding, ``n > 1``, log-probabilities, text stop strings), engines that return
no token ids (kinds other than ``vllm`` and ``sim``), a cut before any event (nothing to resume
from), and a stream past its ``migration_limit``. Non-streamed requests are never cut in front of
the client: a failure before the answer is read is retried whole on another engine before any
byte is sent (``dispatch_attempts``), so they need no migration.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from gateway import metrics
from gateway.api.errors import GatewayError, encode_body
from gateway.api.request_parse import COMPLETION_DEFAULT_MAX_TOKENS
from gateway.fleet.registry import EngineRecord, RunningEntry
from gateway.serving.call import Call, ClientGone
from gateway.serving.relay import event_limit, record_usage, role_only, send_bounded
from gateway.serving.stream_state import PARSED_KEYS, PARSED_OUTPUT, Cut, StreamLedger, valid_token_ids
from gateway.serving.watchdog import time_limit_at
from gateway.sse import OversizedEvent, SseFramer, sse_data
from gateway.tracing import EVENT_FIRST_TOKEN, EVENT_MIGRATION, Span, fail, now_ns
from policies.api import RequestView, Role
from policies.migration import (
    UNSUPPORTED_FIELDS,
    Candidate,
    MigrationReason,
    MigrationSettings,
    StreamView,
    batch_reason,
    decide_on_failure,
    decide_on_slack,
    unsupported,
)

if TYPE_CHECKING:
    from gateway.serving.collocated import CollocatedFlow

log = logging.getLogger("slogate.migration")

COMPLETIONS = "/v1/completions"
PATHS = {"chat": "/v1/chat/completions", "completions": COMPLETIONS}
#: engine kinds that return token ids (``return_token_ids``) and take a token-id prompt
TOKEN_ID_KINDS = frozenset(("vllm", "sim"))
#: token counts an engine reports at or above this are not believed
_COUNT_END = 1 << 40
#: body fields :func:`policies.migration.unsupported` reads; a body with none of them is
#: accepted without decoding it (a large body parsed in a worker stays undecoded)
_POLICY_FIELDS = UNSUPPORTED_FIELDS
#: sampling fields carried to the continuation as the client sent them (the rest of a chat or
#: completions body describes the prompt or the answer's shape, which the continuation replaces)
_CARRIED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "user",
)
#: client headers a continuation does not repeat: a simulated fault targets the engine it first
#: reached, and the natural output length is carried in the body, less what was already relayed
_NOT_REPEATED = frozenset(("x-sim-fault", "x-sim-output-len"))


def _scalar(value: Any) -> str | int | float | None:
    """An engine's identifying field as the client's chunks repeat it: a string or a number
    (64-bit), else nothing (a deeply nested value could not be written again)."""
    if isinstance(value, str) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 64:
        return value
    return None


class _Shape:
    """Chunks in the client's shape under the first engine's id, ``created`` and model."""

    __slots__ = ("chat", "head")

    def __init__(self, kind: str, first: dict[str, Any]) -> None:
        self.chat = kind == "chat"
        ident = {
            "id": _scalar(first.get("id")),
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": _scalar(first.get("created")),
            "model": _scalar(first.get("model")),
        }
        self.head = b"data: " + orjson.dumps(ident)[:-1]

    def chunk(self, text: str, ids: list[int] | None, finish: str | None, first: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or finish is None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if ids is not None:
            choice["token_ids"] = ids
        return self.head + b',"choices":[' + orjson.dumps(choice) + b"]}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self.head + b',"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n"


#: see :attr:`Migrator.decode_placer`
DecodePlacer = Callable[[Call, int, int, list[str], RunningEntry], EngineRecord | None]


class _Resume:
    """What every continuation of one stream shares: its prompt ids, limits and client shape."""

    __slots__ = ("limit", "min_tokens", "natural", "prompt_ids", "shape")

    def __init__(
        self,
        prompt_ids: list[int],
        shape: _Shape,
        limit: int | None,
        min_tokens: int | None,
        natural: int | None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.shape = shape
        #: the client's max_tokens (a completion's default when it gave none; None: a chat
        #: without one, which runs to the end of the context)
        self.limit = limit
        self.min_tokens = min_tokens
        #: the simulated engine's natural output length (sim_output_len / X-Sim-Output-Len)
        self.natural = natural


class _Failed(Exception):
    """The continuation's engine sent something that is not a completion chunk."""


class Migrator:
    """Resumes cut streams of one :class:`CollocatedFlow` (its settings, fleet, dispatch, session)."""

    def __init__(self, flow: CollocatedFlow) -> None:
        self.flow = flow
        #: where a continuation goes for a model served disaggregated (set by the P/D flow):
        #: (call, context tokens, tokens left, engines excluded, the entry to reserve) -> a decode
        #: engine reserved, or None when no decode engine may take it
        self.decode_placer: DecodePlacer | None = None
        s = flow.settings
        self.policy = MigrationSettings(
            limit=s.migration_limit,
            slack=s.migration_slack,
            slack_bound_s=s.migration_slack_bound_s,
            min_remaining_tokens=s.migration_min_remaining_tokens,
            target_margin=s.migration_target_margin,
        )

    # -- before the stream: may it migrate? -------------------------------------------------------

    def ledger(self, call: Call, record: EngineRecord) -> StreamLedger | None:
        """A ledger for a stream about to start on ``record`` (None: not a stream)."""
        request = call.request
        if not request.stream or request.kind in ("embeddings", "responses"):
            # (a Responses stream is typed events over a conversation the engine may store: no
            # continuation on another engine could carry on its numbering and its stored state)
            return None
        blocked = self._blocked(call, record)
        ledger = StreamLedger(blocked)
        if blocked is None and self.policy.slack and call.target.tpot_s > 0:

            async def mover() -> EngineRecord | None:
                return await self._slack_move(call, ledger)

            ledger.watch_slack(call.target.tpot_s, self.policy.slack_bound_s, mover)
        return ledger

    def _blocked(self, call: Call, record: EngineRecord) -> str | None:
        kind = record.adapter.kind
        if kind not in TOKEN_ID_KINDS:
            return f"engine kind {kind!r} returns no token ids"
        request = call.request
        if request.prompts > 1:  # (known from the parse: a body parsed elsewhere stays undecoded)
            return batch_reason(request.prompts)
        if request.media:
            # (a continuation sends the prompt as token ids: an image's placeholders, no image)
            return "a prompt with images, audio or files"
        keys = request.keys if request.parsed is None else request.parsed.keys()
        if not any(key in _POLICY_FIELDS for key in keys):
            return None
        return unsupported(request.body)

    # -- after the cut ----------------------------------------------------------------------------

    async def resume(self, call: Call, cut: Cut, tried: list[str]) -> int:
        """Carry on the stream ``cut`` left, on other engines, within the migration limit; or end
        it with a clear error event. Returns the status the client was given (its headers went
        out with the first engine's)."""
        ledger = call.ledger
        assert ledger is not None, "only a stream with a ledger is cut"
        placed = cut.placed
        if placed is None and ledger.finished and call.usage_told:
            # its finish chunk and its usage went out: only [DONE] was missing, the answer is whole
            # (a finish chunk carrying running usage is not the usage chunk: that one is made below)
            return await self._end_whole(call)
        try:
            while True:
                if placed is None and ledger.finished:
                    state = self._resume_state(call, ledger)
                    if state is not None:  # whole but for its usage: no error, no engine needed
                        # (the engine's running usage, when it sent one, has its cached tokens)
                        return await self._finish(call, ledger, state, None, "", usage=call.usage)
                if placed is None:
                    decision = decide_on_failure(
                        self._view(call, ledger, time.monotonic()),
                        self.policy,
                        cut.reason,
                        ledger.blocked,
                        # nothing relayed yet: the original request is re-sent (a restart)
                        resumable=ledger.first_chunk is None or self._resume_state(call, ledger) is not None,
                    )
                    if not decision.migrate:
                        metrics.child(metrics.MIGRATIONS_REFUSED, _refusal(decision.why)).inc()
                        return await self._give_up(call, cut.error, decision.why)
                state = self._resume_state(call, ledger)
                if state is None and ledger.first_chunk is not None:
                    metrics.child(metrics.MIGRATIONS_REFUSED, "no_token_ids").inc()
                    return await self._give_up(call, cut.error, "not migrated: no token ids to resume from")
                done = self._finished_here(ledger, state) if state is not None else None
                if done is not None and state is not None:
                    return await self._finish(call, ledger, state, None, done)
                ledger.migrations += 1
                ledger.visited.append(cut.engine_id)
                metrics.child(metrics.MIGRATIONS, cut.reason.value).inc()
                outcome: int | Cut | GatewayError | None = None
                for _ in range(self.flow.settings.dispatch_attempts):
                    if placed is None:
                        found = await self._place(call, ledger, state, self._excluded(call, ledger, tried))
                        if isinstance(found, GatewayError):
                            outcome = outcome if isinstance(outcome, GatewayError) else found
                            break
                        placed = found
                    record, placed = placed, None
                    tried.append(record.engine_id)
                    self._announce(call, ledger, cut, record)
                    try:
                        outcome = await self._continue(call, ledger, state, record)
                    finally:
                        self.flow.dispatch.release(record.engine_id, call.rid)
                    if not isinstance(outcome, GatewayError):
                        break
                if isinstance(outcome, int):
                    return outcome
                if isinstance(outcome, Cut):
                    cut, placed = outcome, outcome.placed
                    continue
                metrics.child(metrics.MIGRATIONS_REFUSED, "no_engine").inc()
                why = "no engine could resume it" + (f" ({outcome.message})" if outcome is not None else "")
                return await self._give_up(call, cut.error, f"migration failed: {why}")
        except GatewayError as error:  # the client has the stream's headers: say it in the stream
            return await self._give_up(call, error, "")
        finally:
            if placed is not None:
                self.flow.dispatch.release(placed.engine_id, call.rid)

    def _view(self, call: Call, ledger: StreamLedger, now: float) -> StreamView:
        relayed = len(ledger.tokens()) if ledger.tracking else 0
        return StreamView(
            migrations=ledger.migrations,
            remaining_tokens=max(0, call.request.max_tokens - relayed),
            tpot_target_s=call.target.tpot_s,
            observed_tpot_s=ledger.observed_tpot(now),
            negative_for_s=ledger.negative_for(now),
            recent_tpot_s=ledger.recent_tpot(now),
        )

    def _resume_state(self, call: Call, ledger: StreamLedger) -> _Resume | None:
        state = ledger.resume
        if isinstance(state, _Resume):
            return state
        try:
            first = ledger.first_event()
        except orjson.JSONDecodeError:
            first = None
        if first is None:
            return None
        prompt = first.get("prompt_token_ids")
        if prompt is None:
            choices = first.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                prompt = choices[0].get("prompt_token_ids")
        if not prompt or not valid_token_ids(prompt):
            return None
        request = call.request
        body = request.body
        if request.kind == "chat":
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
        else:  # (a completion without one, or with null, is bounded by the API's default)
            limit = body.get("max_tokens")
            limit = COMPLETION_DEFAULT_MAX_TOKENS if limit is None else limit
        min_tokens = body.get("min_tokens")
        # the simulated engine's own length controls: another engine ignores them, and read as
        # its answer's length they ended a migrated answer early ("stop" at the sim's length)
        origin = self.flow.fleet.records.get(call.engine_id or "")
        natural = (
            body.get("sim_output_len") if origin is not None and origin.adapter.accepts_sim_headers else None
        )
        header = next((v for k, v in call.forward_headers.items() if k.lower() == "x-sim-output-len"), None)
        if origin is not None and origin.adapter.forwards_sim_headers and header is not None:
            header = header.strip()
            if header.isdecimal() and header.isascii():
                natural = int(header) if not isinstance(natural, int) else min(natural, int(header))
        state = _Resume(
            prompt,
            _Shape(request.kind, first),
            limit if isinstance(limit, int) else None,
            min_tokens if isinstance(min_tokens, int) else None,
            natural if isinstance(natural, int) else None,
        )
        ledger.resume = state
        return state

    @staticmethod
    def _finished_here(ledger: StreamLedger, state: _Resume) -> str | None:
        """The answer is already complete: '' when its finish chunk was relayed, else the finish
        reason the budget implies; None when there is more to generate."""
        if ledger.finished:
            return ""
        produced = len(ledger.tokens())
        if state.limit is not None and produced >= state.limit:
            return "length"
        if state.natural is not None and produced >= state.natural:
            return "stop"
        return None

    def _excluded(self, call: Call, ledger: StreamLedger, tried: list[str]) -> list[str]:
        """Engines a continuation may not go to: those that served the stream already (their
        request ids were used, and a failed one may be failing still) and prefill engines."""
        out = set(tried) | set(ledger.visited)
        if call.engine_id:
            out.add(call.engine_id)
        for engine_id, record in self.flow.fleet.records.items():
            # (an engine that returns no token ids cannot be resumed from, nor resume: its text
            # would go to the client unrecorded, and be repeated after the next cut)
            if record.adapter.role is Role.PREFILL or record.adapter.kind not in TOKEN_ID_KINDS:
                out.add(engine_id)
        return sorted(out)

    async def _place(
        self, call: Call, ledger: StreamLedger, state: _Resume | None, exclude: list[str]
    ) -> EngineRecord | GatewayError:
        """Another engine for the rest of the stream, reserved under the request's id."""
        request = call.request
        target = call.target
        relayed = len(ledger.tokens())
        prompt = (len(state.prompt_ids) if state is not None else request.prompt_tokens) + relayed
        remaining = max(1, request.max_tokens - relayed)
        view = RequestView(
            request_id=call.rid,
            model=request.model,
            prompt_tokens=prompt,
            max_output_tokens=remaining,
            arrival=call.arrival,
            priority=call.queue_priority,
            task=target.slo_class,
            tenant=call.tenant,
            lora=request.lora,
        )
        entry = RunningEntry(prompt, remaining, target.tpot_s, 0.0)
        asked = time.monotonic()
        asked_ns = now_ns() if call.span is not None else 0
        attempt = len(ledger.visited) + 1
        placer = self.decode_placer
        if placer is not None and self.flow.fleet.has_prefill_pool(request.model):
            # a P/D model's streams decode on its decode engines: the continuation goes there
            placed = placer(call, prompt, remaining, exclude, entry)
            if placed is None:
                error = GatewayError(
                    503,
                    f"no decode engine of model {request.model!r} can take the stream",
                    code="no_healthy_engine",
                )
                self.flow._decided(call, attempt, asked, asked_ns, False, None, error, exclude)
                return error
            self.flow._decided(call, attempt, asked, asked_ns, False, placed, None, exclude)
            return placed
        try:
            record = await self.flow.dispatch.place(
                view, target.ttft_s, target.tpot_s, target.slo_class, entry, exclude
            )
        except GatewayError as error:
            self.flow._decided(call, attempt, asked, asked_ns, False, None, error, exclude)
            return error
        # the dispatch span and /dashboard's decision log, as for any placement
        self.flow._decided(call, attempt, asked, asked_ns, False, record, None, exclude)
        return record

    async def _slack_move(self, call: Call, ledger: StreamLedger) -> EngineRecord | None:
        """The slack trigger: an engine reserved for the move, or None to stay where it is."""
        now = time.monotonic()
        state = self._resume_state(call, ledger)
        if state is None:
            return None
        exclude = set(self._excluded(call, ledger, []))
        relayed = len(ledger.tokens())
        if ledger.blocked is not None:  # (its ids turned out malformed: it cannot move)
            return None
        context = len(state.prompt_ids) + relayed
        remaining = call.request.max_tokens - relayed
        if state.limit is not None:
            remaining = min(remaining, state.limit - relayed)
        if state.natural is not None:
            remaining = min(remaining, state.natural - relayed)
        candidates = self._candidates(call, exclude, context, max(0, remaining), now)
        view = self._view(call, ledger, now)
        view = StreamView(
            view.migrations,
            max(0, remaining),
            view.tpot_target_s,
            view.observed_tpot_s,
            view.negative_for_s,
            view.recent_tpot_s,
        )
        decision = decide_on_slack(view, candidates, self.policy)
        if not decision.migrate:
            return None
        targets = set(decision.targets)
        others = [e for e in self.flow.fleet.records if e not in targets]
        found = await self._place(call, ledger, state, sorted(exclude | set(others)))
        if isinstance(found, GatewayError):
            return None
        log.info(
            "slack move: %s",
            decision.why,
            extra={"request_id": call.client_rid, "engine": call.engine_id, "target": found.engine_id},
        )
        return found

    def _candidates(
        self, call: Call, exclude: set[str], context: int, remaining: int, now: float
    ) -> list[Candidate]:
        """The engines a slow stream could move to, with room and their predicted decode pace."""
        fleet = self.flow.fleet
        max_load = getattr(self.flow.dispatch.core, "max_engine_load", None)
        need = context + remaining
        out: list[Candidate] = []
        model = call.request.model
        pool = (
            fleet.decode_pool(model, now) if fleet.has_prefill_pool(model) else fleet.candidates(model, now)
        )
        for snap in pool:
            if snap.role is Role.PREFILL or snap.engine_id in exclude:
                continue
            record = fleet.records[snap.engine_id]
            free = record.free_kv_tokens()
            room = (max_load is None or snap.in_flight < max_load) and (free is None or free >= need)
            prefill, decode = self.flow.slo.coefficients(snap.engine_id)
            running = snap.state.num_running if snap.state is not None else 0
            batch = max(snap.in_flight, running) + 1
            tpot = decode[0] + decode[1] * (snap.running_tokens + context) + decode[2] * batch
            # the re-prefill waits for the prompts already queued there (a burst of moves, say)
            queued = sum(record.unprefilled.values()) + context
            resume = prefill[0] + prefill[1] * queued + prefill[2] * queued * queued
            out.append(Candidate(snap.engine_id, room, tpot, resume))
        return out

    def _announce(self, call: Call, ledger: StreamLedger, cut: Cut, record: EngineRecord) -> None:
        relayed = len(ledger.tokens())
        if call.span is not None:
            call.span.add_event(
                EVENT_MIGRATION,
                {
                    "slogate.migration.reason": cut.reason.value,
                    "slogate.migration.from": cut.engine_id,
                    "slogate.migration.to": record.engine_id,
                    "slogate.migration.tokens": relayed,
                    "slogate.migration.count": ledger.migrations,
                },
            )
        log.info(
            "stream migrated from %s to %s (%s) after %d tokens",
            cut.engine_id,
            record.engine_id,
            cut.reason.value,
            relayed,
            extra={
                "request_id": call.client_rid,
                "migration": {
                    "reason": cut.reason.value,
                    "from": cut.engine_id,
                    "to": record.engine_id,
                    "tokens": relayed,
                    "count": ledger.migrations,
                },
            },
        )

    # -- one continuation -------------------------------------------------------------------------

    def _body(
        self, call: Call, record: EngineRecord, ledger: StreamLedger, state: _Resume | None, late: bool
    ) -> bytes:
        if state is None:  # a restart: the client's request as the first engine got it
            return self.flow.body_for(call, record, late=late)
        source = call.request.body
        generated = ledger.tokens()
        relayed = len(generated)
        body: dict[str, Any] = {k: source[k] for k in _CARRIED if k in source}
        body["model"] = call.request.lora or call.request.model  # (a LoRA adapter: its name)
        body["prompt"] = [*state.prompt_ids, *generated]
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True
        if state.limit is not None:
            body["max_tokens"] = state.limit - relayed
        else:
            # a chat without a bound runs to the end of the context; a continuation is a
            # completion, whose default is 16 tokens: it is given the room the engine's context
            # leaves (from its model list; else the gateway's own bound for the request)
            context = record.max_model_len
            room = context - len(state.prompt_ids) if context is not None else call.request.max_tokens
            body["max_tokens"] = max(1, room - relayed)
        if state.min_tokens is not None:
            body["min_tokens"] = max(0, state.min_tokens - relayed)
        if state.natural is not None:
            body["sim_output_len"] = state.natural - relayed
        adapter = record.adapter
        # as the first engine was sent: the TTFT deadline (its first token is settled, so the
        # late lane has nothing left to protect)
        if adapter.accepts_priority:
            body["priority"] = adapter.deadline_priority(
                call.arrival + call.target.ttft_s + self.flow.shared_offset()
            )
        return encode_body(body)

    def _headers(self, call: Call, record: EngineRecord) -> dict[str, str]:
        adapter = record.adapter
        forwarded = adapter.forwarded_headers(call.forward_headers) if call.forward_headers else None
        if forwarded:
            forwarded = {k: v for k, v in forwarded.items() if k.lower() not in _NOT_REPEATED}
        return adapter.upstream_headers(call.rid, forwarded)

    async def _continue(
        self, call: Call, ledger: StreamLedger, state: _Resume | None, record: EngineRecord
    ) -> int | Cut | GatewayError:
        """The rest of the stream on ``record``: the status sent, a Cut (it left this engine too),
        or a retryable error before the engine sent anything."""
        flow = self.flow
        settings = flow.settings
        entry = record.running.get(call.rid) or RunningEntry(0, 0, call.target.tpot_s, 0.0)
        url = record.adapter.url(COMPLETIONS if state is not None else PATHS[call.request.kind])
        try:
            payload = self._body(call, record, ledger, state, entry.late)
        except GatewayError as exc:
            return exc  # (a body that cannot be written again: no engine would get it)
        headers = self._headers(call, record)
        call.engine_id = record.engine_id
        ledger.stall_cut = False  # (a cut of the engine it left is not this one's)
        call.entry = entry
        entry.dispatched_at = time.monotonic()
        metrics.deferred(metrics.DISPATCHES, record.engine_id).inc()
        loop = asyncio.get_running_loop()
        first_at = loop.time() + settings.first_token_timeout_s
        headers_at = min(first_at, loop.time() + settings.headers_timeout_s)
        up = flow.upstream_span(call, record, url, headers) if call.span is not None else None
        try:
            outcome = await self._exchange(
                call, ledger, state, record, entry, url, payload, headers, headers_at, first_at, up
            )
        except BaseException as exc:
            if up is not None:
                _end_span(up, exc)
            raise
        if up is not None:
            _end_span(up, outcome)
        return outcome

    async def _exchange(
        self,
        call: Call,
        ledger: StreamLedger,
        state: _Resume | None,
        record: EngineRecord,
        entry: RunningEntry,
        url: str,
        payload: bytes,
        headers: dict[str, str],
        headers_at: float,
        first_at: float,
        up: Span | None,
    ) -> int | Cut | GatewayError:
        try:
            response = await self.flow.post(call, record, url, payload, headers, headers_at)
        except GatewayError as late:
            # no headers in time: its request is abandoned (the connection closed), and as for a
            # refusal the next attempt may go to another engine (raised, it ended the stream
            # with migrations and attempts left)
            if late.code != "upstream_timeout":
                raise
            return late
        if isinstance(response, GatewayError):
            return response
        if up is not None:
            up.set_attribute("http.response.status_code", response.status)
        try:
            if response.status != 200:  # (any other status is no answer: engine_refused)
                try:
                    return await self.flow.engine_refused(call, record, response, headers_at)
                except GatewayError as refused:
                    # A continuation is the gateway's own request (the prompt and the tokens so far
                    # as ids), not the client's: an engine's 400 (a shorter max_model_len), 429 or
                    # 500 says nothing of the others, and the next attempt goes to another engine
                    return refused
            return await self._relay(call, ledger, state, record, entry, response, first_at)
        finally:
            response.close()  # also aborts the engine's request if it is still running

    async def _relay(
        self,
        call: Call,
        ledger: StreamLedger,
        state: _Resume | None,
        record: EngineRecord,
        entry: RunningEntry,
        response: aiohttp.ClientResponse,
        first_at: float,
    ) -> int | Cut:
        """Relay a continuation: parse each event, re-shape it for the client, record its ids.
        Without ``state`` (a restart: the client has seen no event yet) the first event names the
        stream, as the first engine's would have."""
        send = call.send
        fleet = self.flow.fleet
        engine_id = record.engine_id
        idle_s = self.flow.settings.idle_timeout_s
        clock = asyncio.get_running_loop().time
        base = len(ledger.tokens())
        ledger.on_new_engine()
        usage: dict[str, Any] | None = None
        started = done = sending = False
        # (its first event may echo the prompt it was given: the client's ids and the output's)
        prompt = len(state.prompt_ids) + base if state is not None else call.request.prompt_tokens
        framer = SseFramer(event_limit(prompt))
        # (while it waits on this engine, a stall mark on it cuts the wait: Proxy._on_engine_change)
        try:
            async with time_limit_at(call.watchdog, first_at) as deadline:
                ledger.deadline = deadline
                if ledger.stall_cut:  # (marked while it waited for the engine's headers)
                    deadline.reschedule(clock())
                read = response.content.readany
                while chunk := await read():
                    complete = framer.feed(chunk)
                    if not complete:
                        continue
                    sep = framer.sep
                    out: list[bytes] = []
                    announced = 0  # (role-only events among them: relayed, no token)
                    # The ledger records each event's ids as it is parsed; an event that fails
                    # after others in the same read ends the relay only once those went out: the
                    # next engine continues from the ledger, so what it holds the client must have.
                    failed: Exception | None = None
                    try:
                        for event in complete.split(sep)[:-1]:
                            payload = sse_data(event)
                            payload = payload.strip()
                            if not payload or payload.startswith(b":"):
                                continue
                            if payload == b"[DONE]":
                                done = True
                                break
                            message = orjson.loads(payload)
                            if (
                                not isinstance(message, dict)
                                or "error" in message
                                or message.get("object") == "error"  # (as older vLLM wrote one)
                            ):
                                raise _Failed(f"an error event: {payload[:200]!r}")
                            choices = message.get("choices")
                            if not choices:
                                if isinstance(message.get("usage"), dict):
                                    usage = message["usage"]
                                continue
                            first = state is None
                            if state is None:  # a restart's first event: it names the stream
                                ledger.first_chunk = b"data: " + payload + b"\n\n"
                                state = self._resume_state(call, ledger)
                                if state is None:  # (not resumable: the stream ends here)
                                    raise _Failed("a first event without prompt token ids")
                            choice = choices[0] if isinstance(choices, list) else None
                            if not isinstance(choice, dict):
                                raise _Failed(f"a malformed event: {payload[:200]!r}")
                            ids = choice.get("token_ids")
                            if ids is not None and not valid_token_ids(ids):
                                raise _Failed(f"malformed token ids: {payload[:200]!r}")
                            finish = choice.get("finish_reason")
                            if finish is not None and not isinstance(finish, str):
                                raise _Failed(f"a malformed finish reason: {payload[:200]!r}")
                            if finish == "abort":  # (the engine aborted it: no end, see relay._ABORTED)
                                raise _Failed("the engine aborted the request")
                            delta = choice.get("delta")
                            if isinstance(delta, dict) and any(delta.get(k) for k in PARSED_KEYS):
                                # a restart on an engine that parses reasoning or tool calls: its
                                # events re-shaped as text would drop them (nor can it go on)
                                ledger.blocked, ledger.tracking = PARSED_OUTPUT, False
                                raise _Failed("output the engine parses (reasoning or tool calls)")
                            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                            if text is not None and not isinstance(text, str):
                                raise _Failed(f"malformed text: {payload[:200]!r}")
                            if first and role_only(choice):
                                announced += 1  # (a restart on a chat endpoint opens with it)
                            event_out = state.shape.chunk(text or "", ids, finish, first)
                            # recorded only once the event is sure to go out (see above)
                            if ids:
                                ledger.extend(ids)
                            if finish:
                                ledger.finished = True
                            out.append(event_out)
                    except (_Failed, orjson.JSONDecodeError) as exc:
                        failed = exc
                    now = time.monotonic()
                    if out:
                        # (moved by output alone: keep-alive comments or usage, before the first
                        # output or after it, held a stalled stream, and its engine, for as long
                        # as they came)
                        deadline.reschedule(clock() + idle_s)
                    content = len(out) - announced
                    if content:
                        ledger.stall_cut = False  # (it is no longer stalled)
                        if not started:
                            started = True
                            fleet.mark_prefilled(engine_id, call.rid)
                            if not call.first_at:  # a restart: the client's first token comes now
                                call.first_at = now
                                metrics.deferred(
                                    metrics.TTFT, call.request.model, call.target.slo_class
                                ).observe(now - call.arrival)
                            if call.upstream_span is not None:
                                call.upstream_span.add_event(EVENT_FIRST_TOKEN)
                        call.last_at = now
                        call.content_events += content
                        fleet.add_generated(record, entry, content)
                    if out:
                        ledger.deadline = None  # (not waiting on the engine: a cut waits for the send)
                        sending = True
                        await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                        sending = False
                        ledger.deadline = deadline
                        if ledger.stall_cut:
                            deadline.reschedule(clock())  # the cut held back during the send
                        metrics.SSE_EVENTS.inc(len(out))  # (as the first engine's relay counts)
                    if failed is not None:
                        raise failed
                    if done:
                        break
                    if content and not ledger.finished and ledger.tick(content, now):
                        placed = await ledger.move(now)
                        if placed is not None:
                            return Cut(MigrationReason.SLACK, engine_id, None, placed)
        except TimeoutError:
            if sending:
                metrics.SLOW_CLIENTS.inc()
                raise ClientGone() from None
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "timeout").inc()
            what = "sent no first token" if not started else "stalled between events"
            error = GatewayError(504, f"engine {engine_id} {what} in time", code="upstream_timeout")
            return Cut(MigrationReason.STALL, engine_id, error)
        except (aiohttp.ClientError, _Failed, orjson.JSONDecodeError, OversizedEvent) as exc:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
            error = GatewayError(
                502, f"engine {engine_id} failed mid-stream: {exc!r}", code="upstream_failed"
            )
            return Cut(MigrationReason.FAILURE, engine_id, error)
        finally:
            ledger.deadline = None
        if not done or state is None:
            metrics.child(metrics.UPSTREAM_ERRORS, engine_id, "stream_cut").inc()
            error = GatewayError(
                502, f"engine {engine_id} ended the stream before it was complete", code="upstream_failed"
            )
            return Cut(MigrationReason.FAILURE, engine_id, error)
        return await self._finish(call, ledger, state, record, "", base, usage)

    async def _finish(
        self,
        call: Call,
        ledger: StreamLedger,
        state: _Resume,
        record: EngineRecord | None,
        finish: str,
        base: int | None = None,
        usage: dict[str, Any] | None = None,
    ) -> int:
        """End the stream: a finish chunk if the answer still lacks one, the usage (the client's
        prompt, every output token), ``[DONE]``."""
        if call.watcher is not None:
            call.watcher.cancel()
        call.finished_at = time.monotonic()
        if record is not None:  # the engine's part is over before a slow client takes the last bytes
            self.flow.dispatch.release(record.engine_id, call.rid)
        produced = len(ledger.tokens())
        completion = produced
        # (the engine's figures are its word: one past 64 bits made the usage chunk unwritable)
        reported = usage.get("completion_tokens") if usage is not None else None
        if base is not None and type(reported) is int and 0 <= reported < _COUNT_END:
            completion = base + reported
        prompt = len(state.prompt_ids)
        totals: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        details = usage.get("prompt_tokens_details") if usage is not None else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int:
            totals["prompt_tokens_details"] = {"cached_tokens": max(0, min(prompt, cached))}
        record_usage(call, totals)
        tail = b""
        events = 1  # ([DONE])
        if finish:
            tail += state.shape.chunk("", None, finish)
            call.content_events += 1
            events += 1
        if call.request.client_wants_usage:
            tail += state.shape.usage(totals)
            events += 1
        idle_s = self.flow.settings.idle_timeout_s
        await send_bounded(
            call,
            {"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False},
            idle_s,
        )
        metrics.SSE_EVENTS.inc(events)  # (as the first engine's relay counts its end)
        return 200

    async def _end_whole(self, call: Call) -> int:
        """End a stream whose answer was relayed whole (finish and usage) before its engine cut it."""
        if call.watcher is not None:
            call.watcher.cancel()
        call.finished_at = time.monotonic()
        await send_bounded(
            call,
            {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False},
            self.flow.settings.idle_timeout_s,
        )
        metrics.SSE_EVENTS.inc()
        return 200

    async def _give_up(self, call: Call, error: GatewayError | None, why: str) -> int:
        """End the stream with an error event saying what failed and why it was not resumed."""
        if error is None:
            error = GatewayError(502, "the stream could not be resumed", code="upstream_failed")
        message = f"{error.message}; {why}" if why else error.message
        log.warning(message, extra={"request_id": call.client_rid})
        # the client has part of the answer: a cut stream is a failure, even when what stopped
        # its resumption was a refusal (the gateway out of sockets, an engine's 429 or 400 to the
        # gateway's own continuation request): never the client's fault
        status = 502 if error.status < 500 or error.status == 503 else error.status
        final = GatewayError(status, message, code=error.code or "upstream_failed")
        event = final.sse_event() + b"data: [DONE]\n\n"
        if call.watcher is not None:  # (the response ends here: see end_with_error)
            call.watcher.cancel()
        await send_bounded(call, {"type": "http.response.body", "body": event, "more_body": False}, 1.0)
        return final.status


def _refusal(why: str) -> str:
    if "limit" in why:
        return "limit"
    if "token ids" in why:
        return "no_token_ids"
    return "unsupported"


def _end_span(span: Span, result: int | Cut | GatewayError | BaseException) -> None:
    if isinstance(result, Cut):
        span.set_attribute("slogate.migration.left", result.reason.value)
        if result.error is not None:
            fail(span, result.error.code or str(result.error.status))
    elif isinstance(result, GatewayError):
        fail(span, result.code or str(result.status))
    elif isinstance(result, ClientGone | asyncio.CancelledError):
        span.set_attribute("error.type", "client_disconnected")
    elif isinstance(result, BaseException):
        fail(span, type(result).__name__)
    span.end()


__all__ = ["TOKEN_ID_KINDS", "Migrator"]
