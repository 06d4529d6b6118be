"""Run the gateway under uvicorn with httptools and uvloop (the fast pairing on this hardware)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from gateway.app import FrontDoor, create_app
from gateway.http_head import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_HEAD_BYTES, bounded_head_protocol
from gateway.logs import quiet_repeats, setup_logging
from gateway.open_files import raise_open_files_limit
from gateway.runtime import tune_gc
from gateway.settings import Settings
from gateway.sim.profiles import ProfileError
from policies.api import PolicyConfigError

#: how long past the gateway's own shutdown grace uvicorn waits before it cancels what is left:
#: the gateway ends every open request at its grace (Gateway.begin_shutdown), this is the backstop
SHUTDOWN_BACKSTOP_S = 5.0


def uvicorn_config(settings: Settings, app: FrontDoor | None = None) -> uvicorn.Config:
    config = serving_config(
        app or create_app(settings),
        settings.host,
        settings.port,
        settings.max_head_bytes,
        settings.head_timeout_s,
        settings.body_timeout_s,
    )
    config.timeout_graceful_shutdown = round(settings.shutdown_grace_s + SHUTDOWN_BACKSTOP_S)
    return config


def serving_config(
    app: Any,
    host: str,
    port: int,
    max_head_bytes: int = MAX_HEAD_BYTES,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> uvicorn.Config:
    """How every server of ours is served: uvicorn with httptools (each request's head bounded in
    size and time: :mod:`gateway.http_head`) and uvloop, no access log."""
    for warning in (INVALID_HTTP_WARNING, UNSUPPORTED_UPGRADE_WARNING):
        quiet_repeats(logging.getLogger("uvicorn.error"), warning)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=bounded_head_protocol(max_head_bytes, head_timeout_s, body_timeout_s),
        loop="uvloop",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=30,
        backlog=4096,
    )


#: what uvicorn warns of, once per request, for one that is not HTTP (answered 400 by http_head)
INVALID_HTTP_WARNING = "Invalid HTTP request received."
#: ...and for each upgrade to a protocol it does not serve (h2c, say: answered as plain HTTP)
UNSUPPORTED_UPGRADE_WARNING = "Unsupported upgrade request."


class GatewayServer(uvicorn.Server):
    """uvicorn's server for the gateway: as it stops accepting it tells the gateway, which gives
    open requests ``shutdown_grace_s`` and then ends what is left with answers that say so.
    Without it uvicorn waited for every open stream however long (a hung engine's: for good),
    until the platform killed the process and every stream was cut without a word."""

    def __init__(self, config: uvicorn.Config, front_door: FrontDoor) -> None:
        super().__init__(config)
        self.front_door = front_door
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut_asked = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.front_door.begin_shutdown()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT and not self._cut_asked and self._loop is not None:
            # A second Ctrl-C: end what is still open now, each with its answer, and stop as
            # usual. uvicorn would force the exit instead, skipping the gateway's own shutdown,
            # and cut every open stream without a word. A third one still forces it.
            self._cut_asked = True
            self._loop.call_soon_threadsafe(self.front_door.cut_now)
            return
        super().handle_exit(sig, frame)


class _AnnouncingServer(uvicorn.Server):
    """Prints ``slogate listening on http://HOST:PORT`` once bound (the real port when 0 was asked).

    SIGINT/SIGTERM make :meth:`run` return normally after a graceful shutdown. uvicorn would
    re-raise the signal instead, which kills the process before the caller's cleanup runs
    (``slogate up`` stops its engines after the gateway).
    """

    #: the name the line starts with
    name = "slogate"

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    print(f"{self.name} listening on http://{host}:{port}", flush=True)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening, as uvicorn binds one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096)
    sock.set_inheritable(True)
    return sock


def build_app(settings: Settings) -> Any:
    """The gateway's ASGI app for ``settings``. A profile that names an unknown plugin or holds a
    bad value is a configuration error like any other: one line on stderr and exit status 2."""
    setup_logging(settings.log_level)
    try:
        return create_app(settings)
    except (PolicyConfigError, ProfileError) as exc:  # (routing and SLO profiles; engine latency profiles)
        print(f"slogate: invalid profile: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(settings: Settings, listener: socket.socket | None = None, app: Any = None) -> None:
    """Blocks until SIGINT/SIGTERM; uvicorn drains connections and runs the lifespan shutdown.
    ``listener``: a socket already bound (else uvicorn binds ``settings.host:port``); ``app``: one
    :func:`build_app` made (else it is made here, before anything listens)."""
    if app is None:
        app = build_app(settings)
    tune_gc()  # modules, settings and profiles live as long as the process (gateway.runtime)
    raise_open_files_limit()  # two sockets a stream
    _AnnouncingGateway(uvicorn_config(settings, app), app).run(None if listener is None else [listener])


class _AnnouncingGateway(_AnnouncingServer, GatewayServer):
    """The gateway's server with the line that says where it listens."""
