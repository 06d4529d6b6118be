"""Embeddings pass through to an engine that serves them (their spans: tests/gateway/test_tracing.py)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from aiohttp import web

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
