"""Run a real gateway (uvicorn + httptools + uvloop) in a background thread for in-process tests.

A thread rather than the test's own loop, so the synchronous OpenAI client can call it too.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from opentelemetry.sdk.trace.export import SpanExporter

from gateway.app import FrontDoor, Gateway, create_app
from gateway.server import GatewayServer, uvicorn_config
from gateway.settings import load_settings


@dataclass
class RunningGateway:
    url: str
    app: FrontDoor
    server: uvicorn.Server

    @property
    def gateway(self) -> Gateway:
        return self.app.gateway


@contextmanager
def run_gateway(
    config_file: Path | None = None, *, span_exporter: SpanExporter | None = None, **overrides: Any
) -> Iterator[RunningGateway]:
    """A gateway on a runtime port; ``config_file`` is a YAML file as ``slogate serve --config`` reads.
    ``span_exporter`` receives every span as it ends (with ``tracing=True``)."""
    settings = load_settings(config_file, host="127.0.0.1", port=0, **overrides)
    app = create_app(settings, span_exporter=span_exporter)
    server = GatewayServer(uvicorn_config(settings, app), app)
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    # The gateway serves after one round of health checks or a few seconds, whichever comes
    # first (gateway.app); on a loaded machine the round took longer, and a test's first request
    # met an engine whose first check had not come back (a 503: no engine in rotation). Each
    # check ends within its timeout, failed or not, so the round ends.
    monitor = app.gateway.monitor
    deadline = time.monotonic() + 30
    while monitor is not None and not monitor.first_round.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield RunningGateway(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(15)
        if thread.is_alive():  # (what it is stuck on, for the failure's report)
            frame = sys._current_frames().get(thread.ident or 0)
            if frame is not None:
                print("gateway thread stuck at:\n" + "".join(traceback.format_stack(frame)))
            loop = server._loop
            for task in asyncio.all_tasks(loop) if loop is not None else ():
                print("pending task:", task)
                task.print_stack()
        assert not thread.is_alive(), "gateway thread did not stop"


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
