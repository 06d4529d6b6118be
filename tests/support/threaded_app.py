"""Servers for tests that run on an event loop of their own, in a daemon thread, so they keep
answering while the test (or the test's own loop) blocks.

- :class:`LoopThread`: the loop and its thread; coroutines are submitted from the test's thread.
- :class:`ThreadedApp`: an aiohttp app on that loop, bound to 127.0.0.1 on a free port. A
  subclass builds the app in :meth:`ThreadedApp.build` (on the loop) and may release whatever its
  handlers wait on in :meth:`ThreadedApp.before_cleanup`; ``with`` starts it and sets ``.url``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, ClassVar, Self, TypeVar

from aiohttp import web

T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread; coroutines are submitted from the test's thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ThreadedApp:
    """An aiohttp app served on ``127.0.0.1`` (port 0) from a :class:`LoopThread`.

    ``url`` is its address once started. :meth:`stop` (also ``__exit__``) releases waiting
    handlers, cleans the runner up, then stops and closes the loop; it is idempotent.
    """

    thread_name: ClassVar[str] = "threaded-app"
    #: keyword arguments for :class:`aiohttp.web.AppRunner`
    runner_options: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.url = ""
        self._io = LoopThread(self.thread_name)
        self._runner: web.AppRunner | None = None
        self._stopped = False

    async def build(self) -> web.Application:
        """The app to serve; runs on the server's loop."""
        raise NotImplementedError

    async def before_cleanup(self) -> None:
        """Runs on the loop before the runner is cleaned up (release hanging handlers here)."""

    def __enter__(self) -> Self:
        self._io.start()
        try:
            self._io.run(self._start())
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving (the port then refuses connections); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._io.run(self._stop())
        finally:
            self._io.stop()

    async def _start(self) -> None:
        self._runner = web.AppRunner(await self.build(), **self.runner_options)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _stop(self) -> None:
        await self.before_cleanup()
        if self._runner is not None:
            await self._runner.cleanup()
