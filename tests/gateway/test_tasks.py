"""Background tasks: stopping them (every one ends, a task's own error does not fail the stop, and a
cancellation of the stopping task itself is not swallowed), and delayed wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tasks import DelayedWake, cancel_and_wait


async def test_every_task_ends_whatever_it_ended_with(caplog: pytest.LogCaptureFixture) -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise RuntimeError("its own bug")

    async def ignores_one_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # (cleans up, then ends)

    tasks = [asyncio.create_task(f(), name=f.__name__) for f in (forever, fails, ignores_one_cancel)]
    await asyncio.sleep(0)
    await cancel_and_wait(*tasks, None)
    # (each ended as it would: the waiting one cancelled, the failed one with its own error,
    # logged and not raised, the one that cleaned up on its cancellation with its own end)
    assert [t.cancelled() for t in tasks] == [True, False, False]
    assert isinstance(tasks[1].exception(), RuntimeError) and tasks[2].exception() is None
    logged = [r for r in caplog.records if "had ended with an error" in r.getMessage()]
    assert len(logged) == 1 and "fails" in logged[0].getMessage()


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def retry_loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # (what a client library turning it into its own error amounts to)

    task = asyncio.create_task(retry_loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 5.0)
    assert task.cancelled() and swallowed == 1


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


async def test_a_tasks_own_error_is_logged_not_raised_unless_told_not_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("its own bug")

    for report in (True, False):
        caplog.clear()
        task = asyncio.create_task(fails(), name="the-loop")
        await asyncio.sleep(0)
        await cancel_and_wait(task, report=report)
        logged = [r for r in caplog.records if "the-loop had ended with an error" in r.getMessage()]
        assert len(logged) == (1 if report else 0)
        if report:
            assert logged[0].exc_info is not None and "its own bug" in str(logged[0].exc_info[1])


async def test_a_delayed_wake_takes_every_poke_of_its_delay_in_one_turn() -> None:
    wake = DelayedWake(0.02)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(100):
        wake.poke()
    await wake.wait()
    assert loop.time() - started >= 0.015  # (after the delay, not at the first poke)
    # the pokes before the wait were one turn: nothing is left to wake the next wait
    started = loop.time()
    await wake.wait(timeout=0.05)
    assert loop.time() - started >= 0.04
    # a poke after a turn schedules the next
    wake.poke()
    async with asyncio.timeout(1):
        await wake.wait()
