"""The Responses API (``POST /v1/responses``) through the gateway, against stub engines that fail in
the ways a relay must handle: every event relayed as it came, usage and timing counted from its
typed events, and a stream that fails, stalls or is cut ending with an ``error`` event the
OpenAI SDK reads (never chat's ``[DONE]``), its engine request closed and its seat given back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar
from unittest import mock

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from gateway.serving.call import Call
from gateway.serving.relay import _response_events
from tests.gateway.conftest import MODEL, free_port
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import (
    StubEngine,
    response_event,
    response_object,
    responses_stream,
)
from tests.gateway.test_timeouts import QUIET_MONITOR, metric
from tests.support.threaded_app import ThreadedApp

RESPONSES = "/v1/responses"


def body(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello there", "max_output_tokens": 8, "stream": stream, **extra}


def body_of(**extra: Any) -> dict[str, Any]:
    return body(stream=False, **extra)


def events_of(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The (event line, data) pairs of a Responses stream; asserts each is framed as vLLM frames."""
    out = []
    for event in raw.split(b"\n\n")[:-1]:
        if event.startswith(b":"):
            continue  # (a keep-alive comment)
        head, data = event.split(b"\n", 1)
        assert head.startswith(b"event: ") and data.startswith(b"data: "), event
        out.append((head[7:].decode(), orjson.loads(data[6:])))
    return out


@pytest.fixture()
def stub_gateway(request: pytest.FixtureRequest) -> Iterator[tuple[StubEngine, RunningGateway]]:
    behaviour, settings = request.param
    with StubEngine(behaviour) as engine:
        overrides = {**QUIET_MONITOR, **settings}
        with run_gateway(engines=[engine.entry("stub")], **overrides) as gw:
            yield engine, gw


def _seats(gw: RunningGateway) -> int:
    fleet = gw.gateway.fleet
    assert fleet is not None
    return fleet.records["stub"].in_flight


@pytest.mark.parametrize("stub_gateway", [(responses_stream(5), {})], indirect=True)
def test_a_stream_is_relayed_untouched_and_counted_from_its_typed_events(
    stub_gateway: tuple[StubEngine, RunningGateway],
) -> None:
    engine, gw = stub_gateway
    tokens0 = metric(gw, "slogate_tokens_total", model=MODEL, kind="completion")
    met0 = metric(gw, "slogate_slo_requests_total", slo_class="default", outcome="met")
    ttft0 = metric(gw, "slogate_time_to_first_token_seconds_count", model=MODEL, slo_class="default")
    with httpx.stream("POST", gw.url + RESPONSES, json=body(), timeout=10) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/event-stream"
        raw = answer.read()
    kinds = [kind for kind, _ in events_of(raw)]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events_of(raw)] == list(range(len(kinds)))
    assert b"[DONE]" not in raw  # (chat's end marker is no Responses event)
    # nothing injected for chat (stream_options, return_token_ids) reached the engine
    assert set(engine.received[-1]) <= {*body(), "priority"}
    assert metric(gw, "slogate_tokens_total", model=MODEL, kind="completion") - tokens0 == 5
    assert metric(gw, "slogate_slo_requests_total", slo_class="default", outcome="met") - met0 == 1
    assert (
        metric(gw, "slogate_time_to_first_token_seconds_count", model=MODEL, slo_class="default") - ttft0 == 1
    )
    assert _seats(gw) == 0


@pytest.mark.parametrize("stub_gateway", [(responses_stream(3), {})], indirect=True)
def test_the_openai_sdk_reads_the_relayed_stream(stub_gateway: tuple[StubEngine, RunningGateway]) -> None:
    _, gw = stub_gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with client.responses.stream(model=MODEL, input="hello", max_output_tokens=8) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) == 3 and final.output_text == "".join(deltas)
    assert final.id == "resp_stub1" and final.usage is not None and final.usage.output_tokens == 3


@pytest.mark.parametrize("stub_gateway", [(responses_stream(2, end="error"), {})], indirect=True)
def test_an_engine_error_event_ends_the_stream_as_a_failure(
    stub_gateway: tuple[StubEngine, RunningGateway],
) -> None:
    _, gw = stub_gateway
    failed0 = metric(
        gw, "slogate_requests_total", route="responses", model=MODEL, slo_class="default", status="5xx"
    )
    with httpx.stream("POST", gw.url + RESPONSES, json=body(), timeout=10) as answer:
        raw = answer.read()
    events = events_of(raw)
    assert events[-1][0] == "error" and events[-1][1]["message"] == "stub failed mid-stream"
    assert [k for k, _ in events].count("response.output_text.delta") == 2
    assert metric(
        gw, "slogate_requests_total", route="responses", model=MODEL, slo_class="default", status="5xx"
    ) == (failed0 + 1)
    assert _seats(gw) == 0


@pytest.mark.parametrize(
    "stub_gateway",
    [
        (responses_stream(1, end="stall", ping=True), {"idle_timeout_s": 1.0}),
        (responses_stream(2, end="cut"), {}),
    ],
    indirect=True,
    ids=["stall", "cut"],
)
def test_a_stalled_or_cut_stream_ends_with_an_error_event_the_sdk_reads(
    stub_gateway: tuple[StubEngine, RunningGateway],
) -> None:
    engine, gw = stub_gateway
    started = time.monotonic()
    with httpx.stream("POST", gw.url + RESPONSES, json=body(), timeout=20) as answer:
        raw = answer.read()
    assert time.monotonic() - started < 10
    events = events_of(raw)
    kind, error = events[-1]
    assert kind == "error" and error["type"] == "error", events[-1]
    assert error["code"] in ("upstream_timeout", "upstream_failed")
    # numbered after what was relayed, as the engine's own events are
    assert error["sequence_number"] == len(events) - 1
    assert b"[DONE]" not in raw
    wait_until(lambda: _seats(gw) == 0, 5)
    if engine.received and "stall" in str(events):
        wait_until(lambda: engine.aborted == 1, 5)  # the engine's request was closed with it


async def _no_responses_route(_: StubEngine, request: web.Request) -> web.StreamResponse:
    return web.Response(status=404, text="404: Not Found")  # (aiohttp's own, for a route it lacks)


async def _unknown_response(_: StubEngine, request: web.Request) -> web.StreamResponse:
    error = {"message": "Response with id 'resp_x' not found.", "type": "invalid_request_error", "code": 404}
    return web.json_response({"error": error}, status=404)


@pytest.mark.parametrize("stub_gateway", [(_no_responses_route, {})], indirect=True)
def test_an_engine_without_the_responses_api_is_named(
    stub_gateway: tuple[StubEngine, RunningGateway],
) -> None:
    _, gw = stub_gateway
    answer = httpx.post(gw.url + RESPONSES, json=body(stream=False), timeout=10)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_not_supported" and "/v1/responses" in error["message"]


@pytest.mark.parametrize("stub_gateway", [(_unknown_response, {})], indirect=True)
def test_an_engines_own_404_is_relayed(stub_gateway: tuple[StubEngine, RunningGateway]) -> None:
    _, gw = stub_gateway
    answer = httpx.post(gw.url + RESPONSES, json=body(stream=False), timeout=10)
    assert answer.status_code == 404 and "resp_x" in answer.json()["error"]["message"], answer.text


async def _whole(_: StubEngine, request: web.Request) -> web.StreamResponse:
    return web.json_response(response_object("resp_whole", "completed", "all of it", 4))


@pytest.mark.parametrize("stub_gateway", [(_whole, {})], indirect=True)
def test_a_whole_answer_is_counted(stub_gateway: tuple[StubEngine, RunningGateway]) -> None:
    _, gw = stub_gateway
    tokens0 = metric(gw, "slogate_tokens_total", model=MODEL, kind="prompt")
    answer = httpx.post(gw.url + RESPONSES, json=body(stream=False), timeout=10)
    assert answer.status_code == 200 and answer.json()["id"] == "resp_whole"
    assert metric(gw, "slogate_tokens_total", model=MODEL, kind="prompt") - tokens0 == 7
    # a whole answer to a streamed request is final, as for chat (generated, not retried)
    streamed = httpx.post(gw.url + RESPONSES, json=body(stream=True), timeout=10)
    assert streamed.status_code == 502 and "without a stream" in streamed.json()["error"]["message"]


def _call() -> Call:
    from gateway.api.request_parse import parse_request

    request = parse_request("responses", orjson.dumps(body()), 100)
    return Call(request, "g1", "c1", 0.0, None, None, None, (), {})  # type: ignore[arg-type]


def test_the_event_reader_counts_deltas_and_reads_the_end() -> None:
    call = _call()
    # the response echoes what the client sent (its metadata, instructions): text that ends in
    # ".delta" there, or in a delta, is no output event
    echoed = {**response_object("resp_a", "in_progress"), "metadata": {"tag": "v2.delta"}}
    opened = response_event("response.created", 0, response=echoed)
    deltas = b"".join(
        response_event("response.output_text.delta", i + 1, delta='say "error" .delta"' if i else "e.delta")
        for i in range(3)
    )
    end = response_event("response.completed", 4, response=response_object("resp_a", "completed", "x", 3))
    # (a read of deltas alone takes the fast path: no JSON decoded)
    with mock.patch("gateway.serving.relay._response_event_type", side_effect=AssertionError("decoded")):
        assert _response_events(call, deltas, b"\n\n") == (deltas, False, 3, 3, -1)
    crlf = deltas.replace(b"\n", b"\r\n")
    assert _response_events(call, crlf, b"\r\n\r\n")[3] == 3
    assert _response_events(call, opened, b"\n\n")[3] == 0
    relayed, done, n, content, failed_at = _response_events(
        call, opened + deltas + end + b": ping\n\n", b"\n\n"
    )
    assert relayed == opened + deltas + end and done and n == 5 and content == 3 and failed_at == -1
    assert call.response_id == "resp_a"
    assert call.usage == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    failed = response_event("error", 2, code="x", message="boom", param=None)
    relayed, done, n, content, failed_at = _response_events(_call(), opened + failed + deltas, b"\n\n")
    assert relayed == opened + failed and done and failed_at == len(opened) and content == 0


class ReadsEngine(ThreadedApp):
    """Stores one response (``resp_known``, made by any POST) and answers a read of it with
    ``status``: an engine whose reads fail in the ways the gateway must say as OpenAI errors."""

    thread_name = "reads-engine"
    runner_options: ClassVar[dict[str, Any]] = {"handler_cancellation": True, "shutdown_timeout": 1.0}

    def __init__(self, status: int, body: bytes, content_type: str, delay_s: float = 0.0) -> None:
        super().__init__()
        self.status, self.body, self.content_type = status, body, content_type
        self.delay_s = delay_s

    async def build(self) -> web.Application:
        async def create(_: web.Request) -> web.Response:
            return web.json_response(response_object("resp_known", "completed", "ok", 1))

        async def read(request: web.Request) -> web.Response:
            if request.match_info["rid"] != "resp_known":
                return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
            await asyncio.sleep(self.delay_s)
            return web.Response(status=self.status, body=self.body, content_type=self.content_type)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        app = web.Application()
        app.router.add_post("/v1/responses", create)
        app.router.add_get("/v1/responses/{rid}", read)
        app.router.add_get("/v1/models", models)
        return app


@pytest.mark.parametrize(
    ("status", "body", "content_type", "expected", "code"),
    [
        (
            401,
            b'{"error": {"message": "bad key", "code": 401}}',
            "application/json",
            502,
            "upstream_auth_failed",
        ),
        (500, b"<html>oops</html>", "text/html", 500, None),
        (405, b'{"detail": "Method Not Allowed"}', "application/json", 405, None),
    ],
)
def test_a_failed_read_is_said_as_an_openai_error(
    status: int, body: bytes, content_type: str, expected: int, code: str | None
) -> None:
    with (
        ReadsEngine(status, body, content_type) as engine,
        run_gateway(
            engines=[{"url": engine.url, "kind": "openai", "model": MODEL, "name": "reads"}], **QUIET_MONITOR
        ) as gw,
    ):
        assert httpx.post(gw.url + RESPONSES, json=body_of(), timeout=10).status_code == 200
        answer = httpx.get(gw.url + "/v1/responses/resp_known", timeout=10)
        assert answer.status_code == expected, answer.text
        error = answer.json()["error"]
        assert isinstance(error["message"], str) and "<html>" not in error["message"]
        if code is not None:
            assert error["code"] == code


def test_an_unknown_response_an_engine_could_not_be_asked_about_is_a_503() -> None:
    with (
        ReadsEngine(200, b"{}", "application/json") as engine,
        run_gateway(
            engines=[
                {"url": engine.url, "kind": "openai", "model": MODEL, "name": "reads"},
                {"url": f"http://127.0.0.1:{free_port()}", "kind": "openai", "model": MODEL, "name": "down"},
            ],
            **QUIET_MONITOR,
        ) as gw,
    ):
        wait_until(lambda: not gw.gateway.fleet.records["down"].healthy, 10)  # type: ignore[union-attr]
        unsure = httpx.post(gw.url + RESPONSES, json=body_of(previous_response_id="resp_other"), timeout=10)
        assert unsure.status_code == 503 and unsure.json()["error"]["code"] == "engine_unavailable", (
            unsure.text
        )
        assert "retry-after" in unsure.headers
        read = httpx.get(gw.url + "/v1/responses/resp_other", timeout=10)
        assert read.status_code == 503


def test_a_read_open_when_a_shutdowns_grace_ends_gets_a_503_and_later_ones_too() -> None:
    with (
        ReadsEngine(200, b"{}", "application/json", delay_s=30.0) as engine,
        run_gateway(
            engines=[{"url": engine.url, "kind": "openai", "model": MODEL, "name": "reads"}], **QUIET_MONITOR
        ) as gw,
    ):
        assert httpx.post(gw.url + RESPONSES, json=body_of(), timeout=10).status_code == 200
        answers: list[httpx.Response] = []
        reader = threading.Thread(
            target=lambda: answers.append(httpx.get(gw.url + "/v1/responses/resp_known", timeout=20))
        )
        reader.start()
        proxy = gw.gateway.proxy
        assert proxy is not None
        assert wait_until(lambda: proxy.open_requests == 1, 10)
        ended: list[int] = []
        loop = gw.gateway.dispatch._task.get_loop()  # type: ignore[union-attr]
        loop.call_soon_threadsafe(lambda: ended.append(proxy.cut_open()))
        reader.join(15)
        assert ended == [1] and answers and answers[0].status_code == 503, answers
        assert answers[0].json()["error"]["code"] == "shutting_down"
        late = httpx.get(gw.url + "/v1/responses/resp_known", timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
