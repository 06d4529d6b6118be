"""The per-request record shared by the front door, the serving flows and SLO accounting."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.api.request_parse import ParsedRequest
from gateway.fleet.registry import RunningEntry
from gateway.serving.watchdog import Limit, Watchdog
from policies.slo import SloTarget

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.router import Decision
    from gateway.serving.stream_state import StreamLedger

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected (or stopped reading); nothing more can be sent."""


@dataclass(slots=True)
class Call:
    """Everything tracked about one request while it is served.

    ``rid`` is the gateway's own id: unique per request, the dispatch key and the id engines see.
    ``client_rid`` is the client's ``X-Request-Id`` (or one made up), returned and logged for
    correlation only: two requests may carry the same one.
    """

    request: ParsedRequest
    rid: str
    client_rid: str
    arrival: float
    send: Send
    target: SloTarget
    #: effective priority (header or body, clamped to the SLO profile's levels); None if not given
    priority: int | None
    reply_headers: tuple[tuple[bytes, bytes], ...]
    forward_headers: dict[str, str]
    #: the level queue orders rank by: the priority, or the least urgent its key allows
    queue_priority: int = 0
    #: whose request it is (the API key's tenant), for policies that share the fleet fairly
    tenant: str = "default"
    #: ``x-slo-batch``: requests the client only finds useful together (ranked as one by RED)
    slo_batch: str | None = None
    watcher: asyncio.Task[bool] | None = None
    entry: RunningEntry | None = None
    engine_id: str | None = None
    dispatched_at: float = 0.0
    #: when a P/D request's prefill was sent (its time in the queue ends there, not at the decode)
    prefill_dispatched_at: float = 0.0
    #: the current attempt's engine began an answer that is no error (status below 400): it has
    #: taken up the request (a decode engine has read its KV); an error answer is a refusal
    upstream_answered: bool = False
    #: the current attempt's request may have reached its engine though no answer came (the
    #: connection failed after the request was written, or the answer's headers were late or
    #: malformed): a decode engine may have read its KV, so the handover is not given to another
    upstream_reached: bool = False
    first_at: float = 0.0
    last_at: float = 0.0
    content_events: int = 0
    completion_tokens: int | None = None
    #: the engine's usage-only last chunk came (relayed, or dropped when the client did not ask
    #: for it): with ``continuous_usage_stats`` every chunk carries usage, so a usage figure alone
    #: does not say the stream's usage was told
    usage_told: bool = False
    #: a stream of several choices: content events per choice index (None: one choice)
    choice_events: dict[int, int] | None = None
    #: the engine's latest usage report, counted once when the request ends (relay.count_usage)
    usage: dict[str, Any] | None = None
    finished_at: float = 0.0
    #: time inside the request that was not the gateway's own work: receiving the client's body,
    #: waiting in the admission queue, waiting on engines (see :func:`overhead_header`)
    waited_s: float = 0.0
    #: the gateway's own time up to the response headers, as they are sent (-1: not yet)
    overhead_s: float = -1.0
    #: the response's start (status and headers) went out: an error can only be told in band
    started: bool = False
    #: the request's span when tracing is on (None: no span work at all), and the current
    #: upstream call's, for the first-token event
    span: Span | None = None
    upstream_span: Span | None = None
    #: the gateway itself ended the request: a shutdown's grace ran out (Proxy.cut_open)
    cut: bool = False
    #: what the current stream relayed, when it may migrate to another engine (None: it may not)
    ledger: StreamLedger | None = None
    #: the router's latest decision for it, when the client asked (``x-slogate-debug: 1``)
    decision: Decision | None = None
    #: the handler task's time limits on one timer (None: each limit makes its own)
    watchdog: Watchdog | None = None
    #: SSE events relayed so far (a Responses stream's own error event is numbered after them)
    sse_events: int = 0
    #: a Responses API request: the id its engine gave the response (from the final event or the
    #: body), and the engine it must run on (the one that stored the response it continues)
    response_id: str | None = None
    pinned: str | None = None
    #: engines this request failed on before anything reached the client (a retry followed):
    #: counted against them only if it is served elsewhere (gateway.serving.outliers)
    failed_on: list[str] | None = None
    #: the time limit of the current attempt's wait on its engine while nothing of the answer has
    #: reached the client (the engine's headers, a whole answer, a stream's first event): run out
    #: at once by :meth:`cut_stalled_wait` (None: no such wait, or not one to cut)
    engine_wait: Limit | None = None
    #: the engine of that wait (a P/D request's prefill engine while it waits on its prefill),
    #: and whether what it waits for shows progress before it ends (a stream's first event)
    wait_engine: str | None = None
    wait_streamed: bool = False
    #: that wait was cut because its engine was marked stalled: the attempt ends in a retryable
    #: error, whatever comes from the engine after (reset for each attempt)
    stall_cut: bool = False
    #: waits of this request cut for a stall, over all its attempts
    stall_cuts: int = 0

    def wait_on_engine(self, limit: Limit, engine_id: str, streamed: bool) -> None:
        """``limit`` bounds the attempt's wait on ``engine_id`` now (see :attr:`engine_wait`). A
        cut made during an earlier wait of the attempt that ended before the cut ran its limit out
        (the engine's headers came in the same loop turn) applies to this one."""
        self.engine_wait = limit
        self.wait_engine = engine_id
        self.wait_streamed = streamed
        if self.stall_cut:
            _run_out(limit)

    def cut_stalled_wait(self) -> bool:
        """The engine of this call's attempt was marked stalled: end its wait on that engine now,
        when nothing of the answer has reached the client, so the request is tried elsewhere
        (the stall check found no progress on the engine for ``stall_after_s``: waiting out
        ``first_token_timeout_s`` for it hung the request). False when there is no such wait."""
        wait = self.engine_wait
        if wait is None or self.stall_cut:
            return False
        self.stall_cut = True
        self.stall_cuts += 1
        _run_out(wait)
        return True

    @property
    def tpot_s(self) -> float | None:
        """The stream's time per output token as its SLO is judged: from its first content event
        to its last, over the engine steps between them. A step sends an event per choice still
        running (``n``, every prompt of a batch): with several, the steps are the longest
        choice's events (counted as events, a stream of four choices was judged at a quarter of
        its real TPOT). None with fewer than two steps."""
        if self.content_events < 2 or not self.first_at:
            return None
        if self.choice_events:
            steps = float(max(self.choice_events.values()))
        else:
            steps = self.content_events / self.request.choices
        if steps <= 1.0:
            return None
        return (self.last_at - self.first_at) / (steps - 1.0)


def _run_out(limit: Limit) -> None:
    """End ``limit`` now (one that ran out just now refuses: its wait is ending already)."""
    with contextlib.suppress(RuntimeError):
        limit.reschedule(asyncio.get_running_loop().time())


OVERHEAD_HEADER = b"x-slogate-overhead-ms"


def overhead_header(call: Call, now: float) -> tuple[bytes, bytes]:
    """``x-slogate-overhead-ms`` for response headers sent at ``now``: arrival to now, less the
    time the request waited on the client's body, in the admission queue and on engines."""
    own = max(0.0, now - call.arrival - call.waited_s)
    call.overhead_s = own
    return OVERHEAD_HEADER, b"%.3f" % (own * 1000.0)
