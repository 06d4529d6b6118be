"""Ending the gateway's background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)

#: how long a cancelled task gets to end (its own bounded clean-up) before it is cancelled again
RECANCEL_S = 2.0


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, report: bool = True) -> None:
    """Cancel ``tasks`` and wait until each has ended. A task that swallows its cancellation (a
    client library that turns it into an error of its own, caught by a retry loop) is cancelled
    again every ``RECANCEL_S``: a stop never hangs on it. A task that had ended with an error of
    its own (a background loop's bug) is logged (``report``), never raised: a stop must not fail
    on it. A cancellation of the caller itself propagates."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    while pending:
        for running in pending:
            running.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for ended in given:
        if ended.cancelled():
            continue
        error = ended.exception()
        if error is not None and report:
            log.error("task %s had ended with an error", ended.get_name(), exc_info=error)


class DelayedWake:
    """A wake-up ``delay_s`` after the first :meth:`poke` since the last :meth:`wait` returned:
    what is poked meanwhile is taken in one turn. Poking costs a flag and at most one timer per
    turn, so it may run on a request's path."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._event = asyncio.Event()
        self._due = False

    def poke(self) -> None:
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_later(self.delay_s, self._event.set)

    async def wait(self, timeout: float | None = None) -> None:
        """Until poked (and its delay passed), or ``timeout`` seconds; then ready for a new poke."""
        if timeout is None:
            await self._event.wait()
        elif timeout > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # (no task per wait, as wait_for makes)
                    await self._event.wait()
        self._event.clear()
        self._due = False
