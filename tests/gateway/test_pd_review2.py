"""Second review of the P/D flow (gateway/serving/disaggregated.py): each test pins one defect
and fails against the code as reviewed. Stub engines (kind ``openai``) as in test_pd_review."""

from __future__ import annotations

from pathlib import Path

import httpx
from aiohttp import web

from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import StubEngine, completion_body, status_after
from tests.gateway.test_pd_review import chat_body, engines, entry, profile


async def bootstrap_prefill(_: StubEngine, request: web.Request) -> web.StreamResponse:
    """An SGLang prefill engine: answers its (non-streamed) prefill request."""
    return web.Response(body=completion_body("x"), content_type="application/json")


def test_bootstrap_decode_refusal_is_reported_not_replaced_by_no_decode_engine(tmp_path: Path) -> None:
    """The NIXL decode stage keeps the decode engine's own error when no other decode engine is
    left (disaggregated.py _decode_stage), but _bootstrap answers a fresh 'no decode engine ...
    in rotation' when place_decode finds nothing: the decode engine's 503 comes back to
    CollocatedFlow.serve, which places the request on the next prefill engine, whose _bootstrap
    excludes the decode engine already tried (progress.decode_tried) and returns 'no decode
    engine', which becomes the client's error (the decode engine is in rotation and said why)."""
    with engines(bootstrap_prefill, bootstrap_prefill, status_after(503, 0.0)) as (p0, p1, decode):
        boot = {"kv_transfer": "bootstrap", "bootstrap_port": 8998}
        config = [
            entry(p0, "p0", "prefill", **boot),
            entry(p1, "p1", "prefill", **boot),
            entry(decode, "d0", "decode"),
        ]
        with run_gateway(engines=config, routing_profile=profile(tmp_path)) as gw:
            response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20)
            assert response.status_code >= 500
            message = response.json()["error"]["message"]
            assert len(decode.received) == 1
            assert "no decode engine" not in message, (
                f"the client was told {message!r}, not the decode engine's 503 (stub answered 503)"
            )


def test_bootstrap_prefill_failure_does_not_discard_a_non_streamed_decode_already_answering(
    tmp_path: Path,
) -> None:
    """_bootstrap closes the decode when its prefill fails 'and not call.first_at': the sign that
    the KV has not arrived. A non-streamed decode never sets first_at, so a prefill whose HTTP
    answer fails after the handover (here: 500 at 0.4 s) cancels a decode engine that is already
    sending its answer (its body began at 0.1 s: its KV had arrived), and the client gets the
    prefill's error instead of the finished answer."""
    import asyncio

    body = completion_body("the answer")

    async def answering_decode(_: StubEngine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.1)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        await asyncio.sleep(0.8)
        await response.write(body[len(body) // 2 :])
        await response.write_eof()
        return response

    with engines(status_after(500, 0.4), answering_decode) as (prefill, decode):
        config = [
            entry(prefill, "p0", "prefill", kv_transfer="bootstrap", bootstrap_port=8998),
            entry(decode, "d0", "decode"),
        ]
        with run_gateway(engines=config, routing_profile=profile(tmp_path)) as gw:
            response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20)
            assert response.status_code == 200, (
                f"{response.status_code} {response.text[:200]}: the decode's answer was thrown away"
            )
