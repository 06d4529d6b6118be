"""One timer for the successive time limits of a request's task.

A request passes through up to five limits in turn (its body, the engine's headers, the engine's
answer or first event and the silences after it, each send to a slow client). ``asyncio.timeout``
makes a loop timer for each and cancels it after: about 8 µs apiece with uvloop, a tenth of what
the gateway spends on a plain request of its own. A :class:`Watchdog` keeps one timer per task.
Entering a limit only stores its deadline; the timer moves only when a limit ends before the time
it is set for. When it fires for a limit that has since ended and a later one is active, it is
set again for that one. A limit that runs out cancels the task, and leaving the limit turns that
cancellation into ``TimeoutError``, as ``asyncio.timeout`` does (a cancellation from elsewhere
passes through).

Limits of one watchdog do not nest and belong to the task that made it; a limit asked for while
one is active, or from another task (a P/D request's concurrent prefill and decode), gets a plain
``asyncio.timeout_at`` instead (see :func:`time_limit_at`).
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType
from typing import Protocol

_INF = math.inf


class Limit(Protocol):
    """What both a watchdog's limit and ``asyncio.timeout_at`` give: a context that raises
    ``TimeoutError`` past its deadline, which can be moved."""

    async def __aenter__(self) -> Limit: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...

    def reschedule(self, when: float | None) -> None: ...


class Watchdog:
    """Time limits of one task (loop time), one at a time, on one loop timer."""

    __slots__ = ("_at", "_busy", "_cancelling", "_expired", "_handle", "_handle_at", "_loop", "task")

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a watchdog belongs to a task")
        self.task = task
        self._loop = asyncio.get_running_loop()
        self._at = _INF  # the active limit's deadline (inf: none, or one without a deadline)
        self._busy = False  # a limit is active (asked for and not yet left)
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = _INF
        self._expired = False
        self._cancelling = 0

    @property
    def active(self) -> bool:
        return self._busy

    def until(self, at: float) -> Watchdog:
        """A limit at loop time ``at``, to enter with ``async with``."""
        if self._busy:
            raise RuntimeError("a watchdog's limits do not nest")
        self._busy = True
        self._at = at
        if at < self._handle_at:
            self._arm(at)
        return self

    def reschedule(self, when: float | None) -> None:
        """Move the active limit to ``when`` (None: no limit), as ``asyncio.Timeout`` does; like
        it, refused for a limit that is not active or has run out (set again, the timer would
        cancel the task a second time, or outside any limit)."""
        if not self._busy:
            raise RuntimeError("no active limit to reschedule")
        if self._expired:
            raise RuntimeError("the limit has run out")
        at = _INF if when is None else when
        self._at = at
        if at < self._handle_at:
            self._arm(at)

    async def __aenter__(self) -> Watchdog:
        self._cancelling = self.task.cancelling()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._at = _INF  # (the timer stays: the next limit, sooner or later, reuses it)
        self._busy = False
        if self._expired:
            self._expired = False
            if self.task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
        return None

    def close(self) -> None:
        """Drop the timer (the task's work is done; a limit still active is abandoned)."""
        self._at = _INF
        self._busy = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._handle_at = _INF

    def _arm(self, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(at, self._fire)
        self._handle_at = at

    def _fire(self) -> None:
        armed = self._handle_at
        self._handle = None
        self._handle_at = _INF
        at = self._at
        if at == _INF:
            return  # the limit it was set for ended, and none is active
        if at <= armed:
            # the limit it was set for (or one since moved earlier): run out. The loop's own
            # clock decides, as for asyncio.timeout (uvloop may run a timer a fraction of its
            # 1 ms tick early)
            self._expired = True
            self.task.cancel()
        else:
            self._arm(at)  # a later limit than the one it was set for


def time_limit_at(dog: Watchdog | None, at: float) -> Limit:
    """A time limit at loop time ``at`` for the running task: on ``dog`` when it is that task's
    and free, else a timer of its own."""
    if dog is None or dog._busy or asyncio.current_task() is not dog.task:
        return asyncio.timeout_at(at)
    return dog.until(at)


def time_limit(dog: Watchdog | None, seconds: float) -> Limit:
    """A time limit ``seconds`` from now (see :func:`time_limit_at`)."""
    return time_limit_at(dog, asyncio.get_running_loop().time() + seconds)
