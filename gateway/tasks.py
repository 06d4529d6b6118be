"""Ending the gateway's background tasks."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` and wait until each has ended, whatever it ended with (a stop must not
    fail on a task's own error); a cancellation of the caller itself still propagates."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    for task in running:
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        except Exception:  # (the task's own failure: it ended, which is all a stop asks)
            pass
