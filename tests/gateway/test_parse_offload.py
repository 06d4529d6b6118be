"""Large bodies are parsed in a worker process: the same answer as parsing in place, errors included."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.errors import GatewayError
from gateway.api.parse_offload import BodyParser
from gateway.api.request_parse import parse_request
from gateway.serving.call import Call
from tests.gateway.test_body_splice import TARGET, _noop, flow, record


async def test_a_large_body_parsed_in_the_worker_matches_parsing_in_place() -> None:
    text = "the quick brown fox jumps over the lazy dog; " * 60_000  # ~2.7 MB
    raw = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 7}
    )
    parser = BodyParser(threshold=1024 * 1024, default_max_tokens=16)
    try:
        offloaded = await parser.parse("chat", raw)
        assert parser._pool is not None  # it really went to the worker
        here = parse_request("chat", raw, 16)
        assert offloaded.parsed is None and offloaded.raw is raw
        for field in (
            "kind",
            "model",
            "stream",
            "client_wants_usage",
            "max_tokens",
            "prompt_tokens",
            "priority",
        ):
            assert getattr(offloaded, field) == getattr(here, field), field
        assert offloaded.keys == frozenset(here.body)
        # the forwarded bytes are spliced without decoding the body on the event loop
        call = Call(offloaded, "sg-1", "c", 10.0, _noop, TARGET, None, (), {})
        sent = flow()._body_for(call, record("vllm", True))
        assert offloaded.parsed is None and orjson.loads(sent)["stream_options"] == {"include_usage": True}
        assert offloaded.body == here.body  # decoded on first use
        with pytest.raises(GatewayError) as bad:
            await parser.parse("chat", b'{"model": "m", "messages": "x", "pad": "' + b"a" * 2_000_000 + b'"}')
        assert bad.value.status == 400 and bad.value.param == "messages"
    finally:
        parser.close()


async def test_a_small_body_is_parsed_in_place() -> None:
    parser = BodyParser(threshold=1024 * 1024, default_max_tokens=16)
    request = await parser.parse("chat", b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert parser._pool is None and request.parsed is not None
