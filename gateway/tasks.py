"""Ending the gateway's background tasks."""

from __future__ import annotations

import asyncio
from typing import Any

#: how long a cancelled task gets before it is cancelled again
RECANCEL_S = 0.5


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` and wait until each has ended, whatever it ended with (a stop must not
    fail on a task's own error). A task that swallows its cancellation (a client library that
    turns it into an error of its own, caught by a retry loop) is cancelled again every
    ``RECANCEL_S``: a stop never hangs on it. A cancellation of the caller itself propagates."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    while pending:
        for running in pending:
            running.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for ended in given:
        if not ended.cancelled():
            ended.exception()  # (retrieved: no "exception was never retrieved" at exit)
