"""The KV-transfer gate: per decode engine, at most N transfers at once, the rest in policy order."""

from __future__ import annotations

import asyncio

import pytest

from gateway.dispatch.transfer_gate import TransferGate
from policies.transfer_order import Fifo, LinkParams, Rmlq, TransferOrder, TransferRequest

LINK = LinkParams(tokens_per_s=1000.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def grant_order(order: TransferOrder) -> list[str]:
    """One link, one transfer at a time: 'first' holds it while three wait; the order they get it."""
    clock = Clock()
    gate = TransferGate(order, 1, clock)
    granted: list[str] = []
    await gate.admit("d0", TransferRequest("first", 100, deadline=100.0))

    async def wait(rid: str, tokens: int, deadline: float | None) -> None:
        await gate.admit("d0", TransferRequest(rid, tokens, deadline))
        granted.append(rid)

    tasks = [
        asyncio.create_task(wait("lax", 100, 1000.0)),  # MLU 0.0001: deferred
        asyncio.create_task(wait("none", 100, None)),  # no deadline: lowest level
        asyncio.create_task(wait("urgent", 400, 1.0)),  # MLU 0.4: top levels
    ]
    await asyncio.sleep(0)
    assert gate.waiting("d0") == 3 and gate.in_flight("d0") == 1
    gate.done("d0", "first")
    await asyncio.sleep(0)
    while len(granted) < 3:
        gate.done("d0", granted[-1])
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    gate.done("d0", granted[-1])
    assert gate.in_flight("d0") == 0 and gate.waiting("d0") == 0
    return granted


def test_rmlq_lets_the_urgent_transfer_go_first_fifo_does_not() -> None:
    assert asyncio.run(grant_order(Rmlq(LINK))) == ["urgent", "lax", "none"]
    assert asyncio.run(grant_order(Fifo())) == ["lax", "none", "urgent"]


def test_at_most_n_in_flight_and_a_cancelled_wait_leaves_no_trace() -> None:
    async def run() -> None:
        gate = TransferGate(Fifo(), 2, Clock())
        await gate.admit("d0", TransferRequest("a", 10))
        await gate.admit("d0", TransferRequest("b", 10))
        waiting = asyncio.create_task(gate.admit("d0", TransferRequest("c", 10)))
        later = asyncio.create_task(gate.admit("d0", TransferRequest("d", 10)))
        await asyncio.sleep(0)
        assert gate.in_flight("d0") == 2 and gate.waiting("d0") == 2
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.waiting("d0") == 1
        gate.done("d0", "a")
        gate.done("d0", "a")  # idempotent: frees nothing more
        await later
        assert gate.in_flight("d0") == 2 and gate.waiting("d0") == 0
        # another engine's link is separate
        await asyncio.wait_for(gate.admit("d1", TransferRequest("e", 10)), 1)
        for rid in ("b", "d"):
            gate.done("d0", rid)
        gate.done("d1", "e")
        assert gate.in_flight("d0") == gate.in_flight("d1") == 0

    asyncio.run(run())


def test_a_wait_granted_and_cancelled_in_the_same_turn_gives_its_turn_back() -> None:
    async def run() -> None:
        gate = TransferGate(Fifo(), 1, Clock())
        await gate.admit("d0", TransferRequest("a", 10))
        waiting = asyncio.create_task(gate.admit("d0", TransferRequest("b", 10)))
        third = asyncio.create_task(gate.admit("d0", TransferRequest("c", 10)))
        await asyncio.sleep(0)
        gate.done("d0", "a")  # grants b...
        waiting.cancel()  # ...whose task is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(third, 1)  # b's turn went to c
        assert gate.in_flight("d0") == 1
        gate.done("d0", "c")
        assert gate.in_flight("d0") == 0 and gate.waiting("d0") == 0

    asyncio.run(run())
