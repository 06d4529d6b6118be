"""POST /v1/embeddings on the sim engine: shapes, determinism, encodings, errors, engine cost."""

from __future__ import annotations

import base64
import math
import struct
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import OpenAI

from gateway.tokenizer import VOCAB_SIZE, encode
from tests.sim.helpers import MODEL
from tests.sim.test_http_api import metric, post
from tests.support.sim_process import SimProcess, start_sim_engine


async def embed(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    return await post(url + "/v1/embeddings", {"model": MODEL, **body})


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


async def test_every_input_form_gives_unit_vectors_and_counts_tokens(engine: SimProcess) -> None:
    texts = ["the quick brown fox", "jumps over", "the lazy dog"]
    status, body = await embed(engine.url, {"input": texts})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("embd-")
    data = body["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and {d["object"] for d in data} == {"embedding"}
    vectors = [d["embedding"] for d in data]
    assert all(len(v) == 384 for v in vectors)  # the profile's default size
    assert all(norm(v) == pytest.approx(1.0, abs=1e-5) for v in vectors)
    assert len({tuple(v) for v in vectors}) == 3  # different inputs, different vectors
    tokens = sum(len(encode(t)) for t in texts)
    assert body["usage"]["prompt_tokens"] == tokens and body["usage"]["total_tokens"] == tokens

    # a string, its token ids, and the same inside a batch: one input, one vector, wherever it comes from
    ids = encode(texts[1])
    _, single = await embed(engine.url, {"input": texts[1]})
    _, by_ids = await embed(engine.url, {"input": ids})
    _, nested = await embed(engine.url, {"input": [encode(texts[0]), ids]})
    assert single["data"][0]["embedding"] == vectors[1]
    assert by_ids["data"][0]["embedding"] == vectors[1]
    assert nested["data"][1]["embedding"] == vectors[1] and nested["data"][0]["embedding"] == vectors[0]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


async def test_vectors_are_the_same_on_another_engine_but_not_with_another_seed(engine: SimProcess) -> None:
    _, here = await embed(engine.url, {"input": "stable across processes"})
    with start_sim_engine("--profile", "zero", "--model", MODEL) as other:
        _, there = await embed(other.url, {"input": "stable across processes"})
    with start_sim_engine("--profile", "zero", "--model", MODEL, "--seed", "7") as reseeded:
        _, changed = await embed(reseeded.url, {"input": "stable across processes"})
    assert there["data"][0]["embedding"] == here["data"][0]["embedding"]
    assert changed["data"][0]["embedding"] != here["data"][0]["embedding"]


async def test_base64_is_little_endian_float32_of_the_float_answer_and_dimensions_truncate(
    engine: SimProcess,
) -> None:
    _, floats = await embed(engine.url, {"input": "encode me", "encoding_format": "float"})
    _, packed = await embed(engine.url, {"input": "encode me", "encoding_format": "base64"})
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert len(raw) == 4 * 384
    assert list(struct.unpack("<384f", raw)) == floats["data"][0]["embedding"]

    _, short = await embed(engine.url, {"input": "encode me", "dimensions": 16})
    vector = short["data"][0]["embedding"]
    full = floats["data"][0]["embedding"]
    assert len(vector) == 16 and norm(vector) == pytest.approx(1.0, abs=1e-5)
    scale = norm(full[:16])
    assert vector == pytest.approx([x / scale for x in full[:16]], rel=1e-5)  # a renormalised prefix


def test_openai_sdk_round_trip(engine: SimProcess) -> None:
    client = OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model=MODEL, input=["one two", "three"])  # the SDK asks for base64
    assert [d.index for d in result.data] == [0, 1]
    assert all(len(d.embedding) == 384 for d in result.data)
    assert result.usage.prompt_tokens == len(encode("one two")) + len(encode("three"))


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({}, "input", "input must be"),
        ({"input": []}, "input", "not empty"),
        ({"input": ""}, "input", "is empty"),
        ({"input": 5}, "input", "input must be"),
        ({"input": ["text", 5]}, "input", "must not mix"),
        ({"input": [[1, 2], []]}, "input", "input[1] is empty"),
        ({"input": [1, True]}, "input", "must not mix"),
        ({"input": [-1, 2]}, "input", "not in the vocabulary"),
        ({"input": [[1, VOCAB_SIZE]]}, "input", "not in the vocabulary"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions", "dimensions"),
        ({"input": "x", "dimensions": 385}, "dimensions", "dimensions"),
        ({"input": "x", "dimensions": "8"}, "dimensions", "dimensions"),
        ({"input": [300] * 40000}, "input", "maximum context length"),
        ({"input": "x", "model": 3}, "model", "model must be a string"),
    ],
)
async def test_bad_input_is_an_openai_shaped_400(
    engine: SimProcess, body: dict[str, Any], param: str, needle: str
) -> None:
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/v1/embeddings", json=body) as r:
        status, answer = r.status, await r.json(content_type=None)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] == 400 and answer["error"]["param"] == param
    assert needle in answer["error"]["message"]


async def test_unknown_model_is_404(engine: SimProcess) -> None:
    status, body = await post(engine.url + "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and body["error"]["param"] == "model"


async def test_embeddings_are_prefilled_by_the_engine(timing_profile: Path) -> None:
    # timing profile: every step that prefills costs 0.3 s, so an embedding cannot come back sooner
    with start_sim_engine("--profile", str(timing_profile), "--model", MODEL, "--time-scale", "10") as proc:
        before = await metric(proc.url, "vllm:prompt_tokens_total")
        generated = await metric(proc.url, "vllm:generation_tokens_total")
        started = time.perf_counter()
        status, answer = await embed(proc.url, {"input": ["alpha beta", "gamma"]})
        elapsed = time.perf_counter() - started
        assert status == 200, answer
        assert elapsed >= 0.3 / 10 * 0.9
        tokens = len(encode("alpha beta")) + len(encode("gamma"))
        assert await metric(proc.url, "vllm:prompt_tokens_total") - before == tokens
        assert await metric(proc.url, "vllm:generation_tokens_total") == generated  # pooling emits nothing
        assert await metric(proc.url, "vllm:request_success_total", finished_reason="stop") >= 2
        assert await metric(proc.url, "vllm:num_requests_running") == 0


async def test_generation_only_engine_refuses_embeddings_by_name() -> None:
    with start_sim_engine("--profile", "zero", "--model", "gen-only", "--no-embeddings") as proc:
        status, body = await post(proc.url + "/v1/embeddings", {"model": "gen-only", "input": "x"})
        assert status == 400
        assert body["error"]["message"] == "The model `gen-only` does not support Embeddings API"
        assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
        status, _ = await post(proc.url + "/v1/completions", {"prompt": "still generates", "max_tokens": 2})
        assert status == 200


async def test_embedding_dim_flag_sets_the_vector_size() -> None:
    with start_sim_engine("--profile", "zero", "--model", MODEL, "--embedding-dim", "32") as proc:
        _, body = await embed(proc.url, {"input": "x"})
    assert len(body["data"][0]["embedding"]) == 32
