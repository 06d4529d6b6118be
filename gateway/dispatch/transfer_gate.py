"""The KV-transfer gate: how many decode stages may pull KV into one decode engine at once, and
which waiting one goes next.

A disaggregated request's KV moves when its decode request reaches the decode engine (NIXL: the
decode engine reads the prefill engine's blocks). The gateway cannot pace the bytes, but it
decides when each decode request is sent, so it orders the transfers that share an engine's
ingress link: at most ``max_transfers`` are in flight per decode engine and the rest wait in the
profile's transfer order (:mod:`policies.transfer_order`: MFS's reverse multi-level queue, or
FIFO). A transfer is over when the decode engine's first token arrives (its KV had to arrive
first) or when the decode stage ends, whichever comes first.

Mechanism only: the order is the pure policy's, time comes from the caller's clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.transfer_order import QueuedTransfer, TransferOrder, TransferQueue, TransferRequest


@dataclass(slots=True)
class _Link:
    """One decode engine's ingress link: transfers in flight and the queue behind them."""

    active: set[str] = field(default_factory=set)
    queue: TransferQueue = field(default_factory=TransferQueue)
    waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)


class TransferGate:
    def __init__(self, order: TransferOrder, max_transfers: int, clock: Callable[[], float]) -> None:
        if max_transfers < 1:
            raise ValueError("max_transfers must be >= 1")
        self.order = order
        self.max_transfers = max_transfers
        self.clock = clock
        self._links: dict[str, _Link] = {}
        #: transfers that had to wait for their turn, since start
        self.waited_total = 0

    def waiting(self, link: str) -> int:
        state = self._links.get(link)
        return 0 if state is None else len(state.queue)

    def in_flight(self, link: str) -> int:
        state = self._links.get(link)
        return 0 if state is None else len(state.active)

    async def admit(self, link: str, request: TransferRequest) -> None:
        """Return when ``request``'s transfer into ``link`` may start. Cancelling the wait
        leaves no trace; the caller must call :meth:`done` once admitted (idempotent)."""
        state = self._links.setdefault(link, _Link())
        rid = request.request_id
        if len(state.active) < self.max_transfers and not state.queue:
            state.active.add(rid)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waited_total += 1
        state.queue = self.order.push(state.queue, request, self.clock())
        state.waiters[rid] = future
        try:
            await future
        except asyncio.CancelledError:
            state.waiters.pop(rid, None)
            if future.done() and not future.cancelled():
                self.done(link, rid)  # admitted in the same turn it was cancelled: give it back
            else:
                state.queue = TransferQueue(
                    tuple(q for q in state.queue.entries if q.request.request_id != rid), state.queue.next_seq
                )
            raise

    def done(self, link: str, request_id: str) -> None:
        """The transfer is over (or never happened): the next waiting one may start."""
        state = self._links.get(link)
        if state is None or request_id not in state.active:
            return
        state.active.discard(request_id)
        now = self.clock()
        while len(state.active) < self.max_transfers and state.queue:
            chosen: QueuedTransfer | None
            chosen, state.queue = self.order.pop(state.queue, now)
            if chosen is None:
                break
            rid = chosen.request.request_id
            future = state.waiters.pop(rid, None)
            if future is None or future.done():
                continue  # its wait was cancelled meanwhile
            state.active.add(rid)
            future.set_result(None)
        if not state.active and not state.queue:
            del self._links[link]
