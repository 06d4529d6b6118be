"""The request task's watchdog: successive time limits on one loop timer, with asyncio.timeout's
semantics (a limit that runs out raises TimeoutError in its block; a cancellation from elsewhere
passes through), and a plain timer whenever it cannot serve (nested, or another task)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.serving.watchdog import Watchdog, time_limit, time_limit_at


class _CountingLoop:
    """Counts the loop timers made while installed (call_at and call_later alike)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.made = 0
        self._call_at = self.loop.call_at

    def __enter__(self) -> _CountingLoop:
        def call_at(when: float, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.made += 1
            return self._call_at(when, callback, *args, **kwargs)

        self.loop.call_at = call_at  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.loop.call_at


async def test_a_limit_that_runs_out_raises_timeout_in_its_block() -> None:
    dog = Watchdog()
    with pytest.raises(TimeoutError):
        async with time_limit(dog, 0.02):
            await asyncio.sleep(5)
    # the task is not left cancelled: its count is back to zero, and the next limit works
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)
    async with time_limit(dog, 1.0):
        await asyncio.sleep(0.01)
    dog.close()


async def test_successive_limits_share_one_timer() -> None:
    dog = Watchdog()
    loop = asyncio.get_running_loop()
    with _CountingLoop() as counting:
        for i in range(50):
            # later and later limits: the timer set for the first serves them all
            async with time_limit_at(dog, loop.time() + 10.0 + i):
                await asyncio.sleep(0)
    assert counting.made == 1
    dog.close()
    assert dog._handle is None


async def test_a_sooner_limit_moves_the_timer_and_is_kept() -> None:
    dog = Watchdog()
    async with time_limit(dog, 10.0):
        await asyncio.sleep(0)
    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        async with time_limit(dog, 0.03):
            await asyncio.sleep(5)
    waited = asyncio.get_running_loop().time() - started
    assert 0.02 <= waited < 1.0
    dog.close()


async def test_a_timer_set_for_an_ended_limit_waits_for_the_active_one() -> None:
    dog = Watchdog()
    async with time_limit(dog, 0.02):
        await asyncio.sleep(0)
    # the timer still stands at 20 ms; this limit is at 1 s and must not end at 20 ms
    started = asyncio.get_running_loop().time()
    async with time_limit(dog, 1.0):
        await asyncio.sleep(0.1)
    with pytest.raises(TimeoutError):
        async with time_limit(dog, 0.1):
            await asyncio.sleep(5)
    assert asyncio.get_running_loop().time() - started >= 0.19
    dog.close()


async def test_reschedule_later_and_earlier() -> None:
    dog = Watchdog()
    loop = asyncio.get_running_loop()
    async with time_limit(dog, 0.1) as limit:
        limit.reschedule(loop.time() + 1.0)  # moved on, as the relay does per event
        await asyncio.sleep(0.2)  # past the first deadline: not cut
    with pytest.raises(TimeoutError):
        async with time_limit(dog, 5.0) as limit:
            limit.reschedule(loop.time() + 0.02)
            await asyncio.sleep(5)
    dog.close()


async def test_running_out_and_a_cancellation_at_once_is_the_cancellation() -> None:
    """The limit runs out in the same turn as the task is cancelled from elsewhere (a client
    that left): the cancellation wins, as with asyncio.timeout, never a TimeoutError."""
    dogs: list[Watchdog] = []
    inside = asyncio.Event()

    async def worker() -> None:
        dog = Watchdog()
        dogs.append(dog)
        try:
            async with time_limit(dog, 10.0):
                inside.set()
                await asyncio.sleep(20)
        finally:
            dog.close()

    task = asyncio.create_task(worker())
    await inside.wait()
    task.cancel()  # the client left...
    dogs[0]._fire()  # ...and in the same turn the limit's timer comes due
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_reschedule_needs_an_active_limit_that_has_not_run_out() -> None:
    dog = Watchdog()
    loop = asyncio.get_running_loop()
    async with time_limit(dog, 1.0) as limit:
        pass
    with pytest.raises(RuntimeError):
        limit.reschedule(loop.time() + 1.0)  # (left: it would cut the task outside any limit)
    with pytest.raises(TimeoutError):
        async with time_limit(dog, 0.01) as limit:
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                with pytest.raises(RuntimeError):
                    limit.reschedule(loop.time() + 1.0)  # (ran out: set again it cuts twice)
                raise
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    dog.close()


async def test_a_limit_without_deadline_still_holds_the_watchdog() -> None:
    dog = Watchdog()
    async with time_limit(dog, 1.0) as limit:
        limit.reschedule(None)
        # (nested: a timer of its own, as ever, not the watchdog's)
        assert isinstance(time_limit(dog, 0.5), asyncio.Timeout)
    dog.close()


async def test_a_cancellation_from_elsewhere_passes_through() -> None:
    async def worker(ready: asyncio.Event) -> None:
        dog = Watchdog()
        try:
            async with time_limit(dog, 10.0):
                ready.set()
                await asyncio.sleep(5)
        finally:
            dog.close()

    ready = asyncio.Event()
    task = asyncio.create_task(worker(ready))
    await ready.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nested_or_foreign_limits_get_their_own_timer() -> None:
    dog = Watchdog()
    async with time_limit(dog, 10.0):
        inner = time_limit(dog, 0.02)  # nested: not the watchdog
        assert inner is not dog
        with pytest.raises(TimeoutError):
            async with inner:
                await asyncio.sleep(5)

    async def other_task() -> bool:
        limit = time_limit(dog, 0.02)  # another task's: not the watchdog either
        try:
            async with limit:
                await asyncio.sleep(5)
        except TimeoutError:
            return limit is not dog
        return False

    assert await asyncio.create_task(other_task())
    dog.close()


async def test_limits_do_not_nest_on_the_watchdog_itself() -> None:
    dog = Watchdog()
    dog.until(asyncio.get_running_loop().time() + 1.0)
    with pytest.raises(RuntimeError):
        dog.until(asyncio.get_running_loop().time() + 2.0)
    dog.close()


async def test_close_leaves_no_timer_and_no_limit() -> None:
    dog = Watchdog()
    dog.until(asyncio.get_running_loop().time() + 0.01)
    dog.close()
    assert not dog.active and dog._handle is None
    await asyncio.sleep(0.03)  # nothing fires: the task is not cancelled
