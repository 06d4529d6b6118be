"""The official openai SDK against the gateway in front of two simulated engines, over real HTTP."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.procs import ChildProcess
from tests.gateway.conftest import MODEL, BrokenEngine, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway

MESSAGES = [{"role": "user", "content": "Tell me about continuous batching in one line."}]


@pytest.fixture(scope="module")
def gw(two_engines: list[ChildProcess]) -> Iterator[RunningGateway]:
    with run_gateway(engines=[engine_entry(e) for e in two_engines], monitor_interval_s=0.2) as running:
        yield running


@pytest.fixture()
def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def aclient(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_fleet(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_models_retrieve_finds_a_served_model_and_names_one_that_is_not(client: openai.OpenAI) -> None:
    """``models.retrieve`` got a bare 404 "Not Found" for the model the gateway serves: an SDK
    user reads that as "no such model"."""
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.body["code"] == "model_not_found" and "no-such/model" in missing.value.message  # type: ignore[index]
    assert client.get("/models/", cast_to=object)["data"][0]["id"] == MODEL  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as long_name:  # (a name is not echoed whole)
        client.models.retrieve("a" * 60_000)
    assert len(long_name.value.message) < 300


def test_every_get_route_answers_head_and_a_405_names_the_allowed_methods(gw: RunningGateway) -> None:
    """HEAD got a 405 wherever GET worked (a monitor's or load balancer's probe), and no 405
    said which methods the route takes."""
    for path in ("/health", "/ready", "/v1/models", f"/v1/models/{MODEL}", "/metrics"):
        head = httpx.head(gw.url + path)
        assert head.status_code == 200 and head.content == b"", path
    refused = httpx.get(gw.url + "/v1/chat/completions")
    assert refused.status_code == 405 and refused.headers["allow"] == "POST"
    assert refused.json()["error"]["code"] == "method_not_allowed"
    posted = httpx.post(gw.url + "/health")
    assert posted.status_code == 405 and "GET" in posted.headers["allow"]
    assert set(posted.json()["error"]) >= {"message", "type"}


def test_a_compressed_request_body_is_a_415_that_says_so(gw: RunningGateway) -> None:
    """Read as JSON, a gzip body got a 400 "not valid UTF-8"."""
    import gzip

    import orjson

    body = gzip.compress(orjson.dumps({"model": MODEL, "messages": MESSAGES}))
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 415 and "gzip" in r.json()["error"]["message"]


def test_chat_non_stream_and_stream_give_the_same_text(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, extra_body={"ignore_eos": True}
    )
    text = plain.choices[0].message.content
    assert text and plain.usage is not None
    assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens > 5

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, extra_body={"ignore_eos": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # the relay neither drops nor alters a byte
    # The gateway asked upstream for usage on its own behalf; a client that did not ask sees none.
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_stream_usage_when_asked(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


def test_request_id_is_forwarded_and_returned() -> None:
    with BrokenEngine(500) as engine:
        entry = {"url": engine.url, "kind": "vllm", "model": MODEL, "name": "recorder"}
        with run_gateway(engines=[entry], monitor_interval_s=0.2) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as given:
                client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=2,
                    extra_headers={"X-Request-Id": "req-abc-123"},
                )
            with pytest.raises(openai.InternalServerError) as generated:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    # the client's id comes back for correlation; the engine sees the gateway's own id, unique
    # per request, so two clients sending the same id can never collide on an engine
    assert given.value.response.headers["x-request-id"] == "req-abc-123"
    engine_ids = [headers["x-request-id"] for headers, _ in engine.received]
    assert len(set(engine_ids)) == 2 and "req-abc-123" not in engine_ids
    made_up = generated.value.response.headers["x-request-id"]
    assert made_up == engine_ids[1]  # without a client id, the gateway's own is returned


@pytest.mark.parametrize(
    ("kind", "low_first", "sign"), [("vllm", None, 1), ("sglang", None, -1), ("sglang", True, 1)]
)
def test_engine_priority_follows_each_engines_direction(kind: str, low_first: bool | None, sign: int) -> None:
    """The gateway sends its TTFT-deadline order as ``priority``; SGLang runs high values first."""
    with BrokenEngine(500) as engine:
        entry = {
            "url": engine.url,
            "kind": kind,
            "model": MODEL,
            "priority_scheduling": True,
            "priority_low_first": low_first,
        }
        with run_gateway(engines=[entry], slo_profile="hyperflexis-4task") as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
            for task in ("wikisql", "medical_qa"):  # lax (20 s TTFT) first, then urgent (0.7 s)
                with pytest.raises(openai.InternalServerError):
                    client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-slo-task": task}
                    )
    lax, urgent = (body["priority"] for _, body in engine.received)
    assert isinstance(lax, int) and isinstance(urgent, int)
    # the urgent request must run first in the engine's own order
    assert (urgent < lax) if sign > 0 else (urgent > lax), (lax, urgent)


async def test_async_client_completions_stream_and_not(aclient: openai.AsyncOpenAI) -> None:
    plain = await aclient.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, extra_body={"ignore_eos": True}
    )
    stream = await aclient.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == plain.choices[0].text and plain.usage is not None and plain.usage.completion_tokens == 8


async def test_async_concurrent_streams_spread_over_both_engines(aclient: openai.AsyncOpenAI) -> None:
    async def one() -> str:
        raw = await aclient.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=30, stream=True, extra_body={"ignore_eos": True}
        )
        parsed = raw.parse()
        stream = await parsed if inspect.isawaitable(parsed) else parsed
        n = 0
        async for chunk in stream:
            n += bool(chunk.choices and chunk.choices[0].delta.content)
        assert n == 30
        return raw.headers["x-slogate-engine"]

    engines = await asyncio.gather(*(one() for _ in range(16)))
    assert set(engines) == {"e0", "e1"}
    assert abs(engines.count("e0") - engines.count("e1")) <= 4


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert "not served here" in info.value.message and info.value.code == "model_not_found"


def test_bad_request_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    assert "max_tokens" in info.value.message


def test_upstream_400_passes_through(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # prompt longer than the engine's context
        client.completions.create(model=MODEL, prompt=list(range(100, 200_100)), max_tokens=4)
    assert info.value.status_code == 400


def test_body_too_large_is_413(gw: RunningGateway) -> None:
    big = "x" * (gw.gateway.settings.max_body_bytes + 10)
    r = httpx.post(
        gw.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": big}]}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_sync_client_from_threads(client: openai.OpenAI) -> None:
    def call(_: int) -> int:
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None
        return r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(call, range(24))) == [3] * 24
    assert threading.active_count() < 50


def test_api_keys_are_enforced(two_engines: list[ChildProcess]) -> None:
    with run_gateway(engines=[engine_entry(two_engines[0])], api_keys=["sk-good"]) as running:
        bad = openai.OpenAI(base_url=running.url + "/v1", api_key="sk-bad", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        good = openai.OpenAI(base_url=running.url + "/v1", api_key="sk-good", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices


@pytest.mark.parametrize(
    ("status", "exc"),
    [
        (500, openai.InternalServerError),
        (429, openai.RateLimitError),
        (422, openai.UnprocessableEntityError),
        (502, openai.InternalServerError),
        (504, openai.InternalServerError),
    ],
)
def test_upstream_errors_are_the_matching_sdk_exception(
    status: int, exc: type[openai.APIStatusError]
) -> None:
    with BrokenEngine(status) as broken:
        entry = {"url": broken.url, "kind": "vllm", "model": MODEL, "name": "broken"}
        with run_gateway(engines=[entry], monitor_interval_s=0.2) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(exc) as info:
                client.chat.completions.create(model=MODEL, messages=MESSAGES)
            assert info.value.status_code == status and "engine exploded" in info.value.message
