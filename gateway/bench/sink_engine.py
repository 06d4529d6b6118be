"""A minimal OpenAI-compatible engine that reads a request and answers at once, without looking at
the prompt: where ``slogate bench large-body`` sends its 15 MB body.

The simulated engine would tokenize those 15 MB (1-3 s of CPU) on the same two cores as the
streams being measured, and the benchmark would see the engine's load instead of the gateway's
event loop. This one costs the read and one byte search.

``python -m gateway.bench.sink_engine --model M [--port 0]`` prints
``slogate-sink listening on http://HOST:PORT`` once bound, and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import orjson
from aiohttp import web


def _chunk(model: str, delta: dict[str, str], finish: str | None) -> bytes:
    payload = {
        "id": "sink",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def build_app(model: str) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def complete(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        # A prompt's quotes are escaped inside a JSON string, so this byte sequence can only be
        # the field itself (the gateway forwards compact orjson output).
        stream = b'"stream":true' in raw
        usage = {"prompt_tokens": len(raw) // 4, "completion_tokens": 1, "total_tokens": len(raw) // 4 + 1}
        if not stream:
            return web.json_response(
                {
                    "id": "sink",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                },
                dumps=lambda v: orjson.dumps(v).decode(),
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        final = orjson.dumps({"id": "sink", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        await response.write(
            _chunk(model, {"role": "assistant", "content": "ok"}, None)
            + _chunk(model, {}, "stop")
            + b"data: "
            + final
            + b"\n\ndata: [DONE]\n\n"
        )
        await response.write_eof()
        return response

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


async def _serve(model: str, host: str, port: int) -> None:
    runner = web.AppRunner(build_app(model), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"slogate-sink listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.sink_engine")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.model, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
