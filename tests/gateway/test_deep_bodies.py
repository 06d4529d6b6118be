"""Bodies the gateway reads but could not write again, and lengths HTTP allows: a clean answer,
never a 500."""

from __future__ import annotations

import httpx
import orjson

from tests.gateway.gateway_thread import run_gateway
from tests.gateway.stub_engines import MODEL, HeaderEngine
from tests.gateway.test_fuzz_requests import Wire, raw_http

HI = [{"role": "user", "content": "hi"}]


def _body(depth: int, **fields: object) -> bytes:
    """A chat body with ``metadata`` nested ``depth`` arrays deep (orjson reads up to 1,024 and
    writes up to 254)."""
    head = orjson.dumps({"model": MODEL, "messages": HI, **fields})[:-1]
    return head + b',"metadata":' + b"[" * depth + b"]" * depth + b"}"


def test_a_body_nested_past_what_can_be_written_again_is_a_400_when_it_must_be() -> None:
    """A body the gateway edits for the engine (here: its priority, which this engine does not
    take) was written again with orjson, which raised past every handler: a 500 and a traceback.
    Forwarded untouched, it reaches the engine as it came."""
    with HeaderEngine() as engine, run_gateway(engines=[engine.entry("e")]) as gw:
        url = gw.url + "/v1/chat/completions"
        edited = httpx.post(url, content=_body(300, priority=0), headers={"content-type": "application/json"})
        assert edited.status_code == 400, edited.text
        error = edited.json()["error"]
        assert error["type"] == "invalid_request_error" and "nests too deeply" in error["message"]
        assert not engine.received
        untouched = httpx.post(url, content=_body(300), headers={"content-type": "application/json"})
        assert untouched.status_code == 200, untouched.text
        # within what orjson writes, an edited body goes through
        shallow = httpx.post(
            url, content=_body(200, priority=0), headers={"content-type": "application/json"}
        )
        assert shallow.status_code == 200, shallow.text


def test_a_content_length_with_leading_zeros_is_its_number() -> None:
    """HTTP allows leading zeros in Content-Length: twenty digits of them were read as a body
    past any limit (a 413)."""
    body = orjson.dumps({"model": MODEL, "messages": HI})
    with HeaderEngine() as engine, run_gateway(engines=[engine.entry("e")]) as gw:
        length = b"0" * 20 + str(len(body)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", length)]
        answer = raw_http(gw.url, Wire("POST", "/v1/chat/completions", headers, [body]))
        assert answer.status == 200, answer.body[:300]
        too_long = [(b"content-type", b"application/json"), (b"content-length", b"0" * 5 + b"99999999999")]
        answer = raw_http(gw.url, Wire("POST", "/v1/chat/completions", too_long, [body]))
        assert answer.status == 413 and orjson.loads(answer.body)["error"]["code"] == "request_too_large"
