"""Token counters through a gateway: each request's usage counted once, with the engine's final
totals. vLLM's ``continuous_usage_stats`` repeats the running totals in every chunk; each was
added, so a stream of four tokens counted its prompt five times."""

from __future__ import annotations

import httpx
import orjson
from aiohttp import web

from gateway import metrics
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import StubEngine, completion_body

CHAT = "/v1/chat/completions"


def _chunk(text: str, done: int) -> bytes:
    return (
        b"data: "
        + orjson.dumps(
            {
                "id": "chatcmpl-usage",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
                "usage": {"prompt_tokens": 3, "completion_tokens": done, "total_tokens": 3 + done},
            }
        )
        + b"\n\n"
    )


async def _running_usage(_: StubEngine, request: web.Request) -> web.StreamResponse:
    if not (await request.json()).get("stream"):
        return web.Response(body=completion_body("ok"), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for done, text in enumerate("abcd", start=1):
        await response.write(_chunk(text, done))
    final = {"id": "chatcmpl-usage", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    await response.write(b"data: " + orjson.dumps({**final, "choices": [], "usage": usage}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _counted() -> tuple[float, float]:
    def value(kind: str) -> float:
        return (
            metrics.REGISTRY.get_sample_value("slogate_tokens_total", {"model": MODEL, "kind": kind}) or 0.0
        )

    return value("prompt"), value("completion")


def test_each_request_counts_its_final_usage_once() -> None:
    with StubEngine(_running_usage) as engine, run_gateway(engines=[engine.entry("e0")]) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        options = {"include_usage": True, "continuous_usage_stats": True}
        before = _counted()
        streamed = httpx.post(
            gw.url + CHAT, json={**body, "stream": True, "stream_options": options}, timeout=10
        )
        assert streamed.status_code == 200 and streamed.content.endswith(b"data: [DONE]\n\n")
        after_stream = _counted()
        assert (after_stream[0] - before[0], after_stream[1] - before[1]) == (3, 4)
        plain = httpx.post(gw.url + CHAT, json=body, timeout=10)
        assert plain.status_code == 200
        after_plain = _counted()
        # completion_body's usage: 1 prompt token, 1 completion token
        assert (after_plain[0] - after_stream[0], after_plain[1] - after_stream[1]) == (1, 1)
