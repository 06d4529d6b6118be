"""Embeddings pass through to an engine that serves them; spans wrap queue wait, dispatch, upstream."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.procs import ChildProcess
from gateway.tracing import Tracing
from tests.gateway.conftest import MODEL, engine_entry
from tests.gateway.gateway_thread import run_gateway
from tests.support.threaded_app import ThreadedApp


class EmbeddingEngine(ThreadedApp):
    """A real HTTP server speaking the OpenAI embeddings route (a pooling engine stand-in)."""

    thread_name = "embedding-engine"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, object]] = []

    async def build(self) -> web.Application:
        async def embed(request: web.Request) -> web.Response:
            body = await request.json()
            self.seen.append(body)
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            data = [
                {"object": "embedding", "index": i, "embedding": [float(len(t)), 0.5, -1.0]}
                for i, t in enumerate(inputs)
            ]
            usage = {"prompt_tokens": sum(len(t.split()) for t in inputs), "total_tokens": 0}
            return web.json_response({"object": "list", "data": data, "model": body["model"], "usage": usage})

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "embedder", "object": "model"}]})

        app = web.Application()
        app.router.add_post("/v1/embeddings", embed)
        app.router.add_get("/v1/models", models)
        return app


@pytest.fixture()
def embedder() -> Iterator[EmbeddingEngine]:
    with EmbeddingEngine() as engine:
        yield engine


def test_embeddings_pass_through(embedder: EmbeddingEngine) -> None:
    entry = {"url": embedder.url, "kind": "openai", "model": "embedder", "name": "emb"}
    with run_gateway(engines=[entry], monitor_interval_s=0.2) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        result = client.embeddings.create(model="embedder", input=["one two", "three"])
        assert [d.embedding for d in result.data] == [[7.0, 0.5, -1.0], [5.0, 0.5, -1.0]]
        assert embedder.seen[-1]["input"] == ["one two", "three"]
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="embedder", input=[])


def test_spans_around_queue_wait_dispatch_and_upstream(two_engines: list[ChildProcess]) -> None:
    exporter = InMemorySpanExporter()
    with run_gateway(engines=[engine_entry(two_engines[0])], tracing=True) as gw:
        gw.gateway.tracing = Tracing(True, exporter=exporter)
        assert gw.gateway.proxy is not None
        gw.gateway.proxy.flow.tracing = gw.gateway.tracing
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers={"X-Request-Id": "r-1"},
        )
        gw.gateway.tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"dispatch", "queue_wait", "upstream"} <= set(spans)
    assert (
        spans["upstream"].parent is not None
        and spans["upstream"].parent.span_id == spans["dispatch"].context.span_id
    )
    assert spans["upstream"].attributes is not None and spans["upstream"].attributes["request_id"] == "r-1"
