"""An engine's error answer: read within its bound, and its time counted as waiting on the engine
only for the request whose wait counts (not for a P/D prefill sent beside its decode)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from gateway.api.request_parse import parse_request
from gateway.serving.call import Call
from gateway.serving.collocated import error_body
from policies.slo import SloSource, SloTarget
from tests.gateway.stub_engines import StubEngine

TARGET = SloTarget(ttft_s=1.0, tpot_s=0.1, slo_class="err-body", source=SloSource.TASK)
BODY_AFTER_S = 0.3


async def _noop(_: object) -> None:
    return None


async def _slow_refusal(_: StubEngine, request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await asyncio.sleep(BODY_AFTER_S)
    await response.write(b'{"error": {"message": "engine broke"}}')
    await response.write_eof()
    return response


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with StubEngine(_slow_refusal) as engine:
        yield engine.url + "/v1/chat/completions"


async def _read(url: str, deadline_in_s: float, count_wait: bool) -> tuple[bytes, Call, float]:
    """The refusal's body as error_body reads it, the call it counted on, and the seconds it took."""
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    call = Call(parse_request("chat", body, 16), "r", "c", 0.0, _noop, TARGET, None, (), {})
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session, session.post(url, data=body) as response:
        assert response.status == 500
        started = loop.time()
        read = await error_body(call, response, started + deadline_in_s, count_wait)
    return read, call, loop.time() - started


@pytest.mark.parametrize("count_wait", [True, False])
async def test_the_body_is_read_and_its_time_counted_only_when_asked(url: str, count_wait: bool) -> None:
    body, call, _ = await _read(url, 5.0, count_wait)
    assert b"engine broke" in body
    if count_wait:
        assert call.waited_s >= BODY_AFTER_S * 0.8
    else:
        assert call.waited_s == 0.0


async def test_a_deadline_already_gone_still_leaves_a_second_to_read(url: str) -> None:
    body, _, took = await _read(url, -10.0, True)
    assert b"engine broke" in body and took < 1.0
