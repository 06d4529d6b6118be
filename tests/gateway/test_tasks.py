"""Stopping background tasks: every one ends, a task's own error does not fail the stop, and a
cancellation of the stopping task itself is not swallowed."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tasks import cancel_and_wait


async def test_every_task_ends_whatever_it_ended_with() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise RuntimeError("its own bug")

    async def ignores_one_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # (cleans up, then ends)

    tasks = [asyncio.create_task(f()) for f in (forever, fails, ignores_one_cancel)]
    await asyncio.sleep(0)
    await cancel_and_wait(*tasks, None)
    assert all(t.done() for t in tasks)


async def test_the_callers_own_cancellation_propagates() -> None:
    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(10)

    inner = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0.01)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    inner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await inner
