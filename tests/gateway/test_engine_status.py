"""An engine answer whose status is neither 200 nor an HTTP error is no completion: the client
gets an OpenAI-shaped 502, never the engine's status.

Found by review: a status HTTP does not define (600) made the gateway start its error answer with
a status line uvicorn cannot write, and the client's connection was dropped with nothing sent; a
streamed 204 was relayed as a 204 whose body uvicorn refused (a logged 500, a bodiless answer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.gateway.conftest import MODEL
from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import StubEngine, chunk_event

QUIET_MONITOR: dict[str, Any] = {"monitor_interval_s": 60.0, "health_timeout_s": 1.0}


def _answers(status: int, sse: bool) -> Callable[[StubEngine, web.Request], Any]:
    async def behaviour(_: StubEngine, request: web.Request) -> web.StreamResponse:
        if sse:
            response = web.StreamResponse(
                status=status, reason="X", headers={"Content-Type": "text/event-stream"}
            )
            await response.prepare(request)
            if status != 204:  # (a 204 has no body: the client would take one for a bad answer)
                await response.write(chunk_event("hi"))
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        body = b'{"id": "x", "object": "chat.completion", "choices": []}'
        return web.Response(status=status, reason="X", body=body, content_type="application/json")

    return behaviour


@pytest.mark.parametrize(
    ("status", "sse", "stream"),
    [
        (600, False, False),
        (600, False, True),
        (999, True, True),
        (204, True, True),
        (201, False, False),
        (302, False, False),
    ],
)
def test_a_status_that_is_no_answer_is_a_502(status: int, sse: bool, stream: bool) -> None:
    with (
        StubEngine(_answers(status, sse)) as engine,
        run_gateway(engines=[engine.entry("odd")], **QUIET_MONITOR) as gw,
    ):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": stream,
        }
        response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 502, (response.status_code, response.content)
        error = response.json()["error"]
        assert error["code"] == "upstream_failed" and f"HTTP {status}" in error["message"]
        assert len(engine.received) == 1  # not retried on the same engine
        fleet = gw.gateway.fleet
        assert fleet is not None and fleet.records["odd"].in_flight == 0


def test_an_engine_s_redirect_is_not_followed() -> None:
    """A 307 from an engine is a 502: following it would send the request, with the engine's API
    key, wherever the engine points."""
    with (
        StubEngine(_answers(200, True)) as elsewhere,
        StubEngine(_redirects_to(elsewhere)) as engine,
        run_gateway(
            engines=[{**engine.entry("redirecting"), "api_key": "sk-engine-secret"}], **QUIET_MONITOR
        ) as gw,
    ):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
        }
        response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 502, (response.status_code, response.content)
        assert "HTTP 307" in response.json()["error"]["message"]
        assert elsewhere.received == []


def _redirects_to(target: StubEngine) -> Callable[[StubEngine, web.Request], Any]:
    async def behaviour(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return web.Response(status=307, headers={"Location": target.url + "/v1/chat/completions"})

    return behaviour
