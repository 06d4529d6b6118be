"""An aiohttp application served on 127.0.0.1 and a port chosen at runtime, for one test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """Serve ``app`` for the block; yields its port, and stops it however the block ends."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
