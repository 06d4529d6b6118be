"""The relay floor: the least a Python relay on the gateway's own stack spends per SSE event.

An ASGI app that forwards every request to one engine and copies the answer back chunk by chunk,
and nothing else (no parsing, routing, accounting, metrics or tracing), served exactly as
``slogate serve`` serves the gateway (uvicorn with httptools and uvloop, an aiohttp client pool
without a connection limit). ``slogate bench overhead --paced-floor`` runs the paced case through
it as well: what the gateway spends per event above this floor is what the gateway's own code
costs, the rest is the stack's (a socket read, a socket write and a task wake per event).

Run as ``python -m gateway.bench.relay_floor ENGINE_URL``: it listens on a free port of 127.0.0.1
and prints ``relay-floor listening on http://HOST:PORT``.
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp

from gateway.server import _AnnouncingServer, serving_config

Scope = dict[str, Any]
#: request headers not forwarded (the client's connection, not the request)
_HOP_BY_HOP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})


class FloorRelay:
    """Forward each request to ``engine_url``; relay the response body as it arrives."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        assert self.session is not None
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k not in _HOP_BY_HOP
        }
        url = self.engine_url + scope["path"]
        async with self.session.request(scope["method"], url, data=body or None, headers=headers) as response:
            content_type = response.headers.get("Content-Type", "application/json")
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [(b"content-type", content_type.encode("latin-1"))],
                }
            )
            read = response.content.readany
            while chunk := await read():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Announcing(_AnnouncingServer):
    name = "relay-floor"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gateway.bench.relay_floor ENGINE_URL", file=sys.stderr)
        return 2
    _Announcing(serving_config(FloorRelay(argv[0]), "127.0.0.1", 0)).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
