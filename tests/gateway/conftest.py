"""Fixtures for gateway tests: simulated engines as real processes, gateways in a thread."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from aiohttp import web

from gateway.procs import ChildProcess, spawn_sim_engine
from tests.support.threaded_app import ThreadedApp

MODEL = "m"
#: a 7B-class engine run 4x faster than real time: decode steps of a few ms, so streams take
#: long enough to interrupt but the suite stays fast
SIM_ARGS = ("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "4")


def engine_entry(engine: ChildProcess, **extra: object) -> dict[str, object]:
    return {"url": engine.url, "kind": "sim", "model": MODEL, "name": engine.name, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_engines() -> Iterator[list[ChildProcess]]:
    with spawn_sim_engine(*SIM_ARGS, name="e0") as e0, spawn_sim_engine(*SIM_ARGS, name="e1") as e1:
        yield [e0, e1]


class BrokenEngine(ThreadedApp):
    """A real HTTP server that answers every data-path call with a fixed status (an engine bug).

    Runs its own event loop in a thread so it answers while the test (or its loop) blocks.
    Records what reached it (headers and JSON body of every data-path call), so tests can check
    what the gateway forwarded.
    """

    thread_name = "broken-engine"

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status
        self.received: list[tuple[dict[str, str], dict[str, object]]] = []

    async def build(self) -> web.Application:
        async def fail(request: web.Request) -> web.Response:
            self.received.append(({k.lower(): v for k, v in request.headers.items()}, await request.json()))
            error = {
                "message": "engine exploded",
                "type": "InternalServerError",
                "param": None,
                "code": self.status,
            }
            return web.json_response({"error": error}, status=self.status)

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", fail)
        app.router.add_post("/v1/completions", fail)
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", ok)
        return app
