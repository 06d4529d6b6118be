"""Second review of the P/D flow (gateway/serving/disaggregated.py): each test pins one defect
and fails against the code as reviewed. Stub engines (kind ``openai``) as in test_pd_review."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.request_parse import parse_request
from gateway.serving import disaggregated
from tests.gateway.gateway_thread import run_gateway, wait_until
from tests.gateway.stub_engines import StubEngine, chunk_event, completion_body, status_after
from tests.gateway.test_pd_review import chat_body, engines, entry, nixl_prefill, profile


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


# -- a non-streamed request whose time ran out before its decode engine is not sent there ----------


def _timeout_blamed_on(url: str, engine: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "slogate_upstream_errors_total" and sample.labels == {
                "engine": engine,
                "kind": "timeout",
            }:
                return sample.value
    return 0.0


async def _decode_answers(engine: StubEngine, request: web.Request) -> web.StreamResponse:
    """A decode engine: a stream's first event after 2 s, a plain answer at once."""
    if engine.received[-1].get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(2.0)
        await response.write(chunk_event("t", 0) + b"data: [DONE]\n\n")
        return response
    return web.Response(body=completion_body("ok"), content_type="application/json")


@pytest.mark.parametrize("held", ["prefill engine", "kv transfer"])
def test_a_request_whose_time_ran_out_before_its_decode_engine_is_not_sent_there(
    tmp_path: Path, held: str
) -> None:
    """A streamed request holds the only prefill engine (``max_engine_load: 1``), or the decode
    engine's one KV-transfer turn (its first token comes after 2 s); a non-streamed request waits
    out its ``request_timeout_s`` behind it. It was then sent to the decode engine all the same
    (whole, as a fallback for a prefill that "failed" with the queue's timeout, or after its
    transfer turn), with no time left: that engine was blamed for a timeout that was not its own,
    and the client told it "did not answer in time"."""

    async def prefill(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        if held == "prefill engine" and len(engine.received) == 1:
            await asyncio.sleep(2.0)  # (the streamed request's prefill)
        return await nixl_prefill(engine, request)

    with engines(prefill, _decode_answers) as (pre, dec):
        config = [entry(pre, "p0", "prefill"), entry(dec, "d0", "decode")]
        gating = (
            # (a slow link: the streamed request's turn lasts until its first token)
            "kv_transfer: {order: fifo, max_per_engine: 1}\ndecode_placement: {transfer_tokens_per_s: 50.0}\n"
            if held == "kv transfer"
            else ""
        )
        settings: dict[str, Any] = {
            "max_engine_load": 1 if held == "prefill engine" else 8,
            "request_timeout_s": 0.6,
            "monitor_interval_s": 60.0,
        }
        routing = profile(tmp_path, mode="conditional", extra=gating)
        with run_gateway(engines=config, routing_profile=routing, **settings) as gw:
            holder = threading.Thread(
                target=httpx.post,
                args=(gw.url + "/v1/chat/completions",),
                kwargs={"json": chat_body(True, max_tokens=8), "timeout": 20},
            )
            holder.start()
            busy = pre if held == "prefill engine" else dec
            assert wait_until(lambda: len(busy.received) == 1, timeout=10)
            sent = time.monotonic()
            response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20)
            waited = time.monotonic() - sent
            holder.join()
            error = response.json()["error"]
            assert response.status_code == 504 and error["code"] == "request_timeout", error
            if held == "kv transfer":  # (the wait for the turn itself ends with its time: not ~2 s)
                assert waited < 1.5, waited
            assert _timeout_blamed_on(gw.url, "d0") == 0.0
            assert [r for r in dec.received if not r.get("stream")] == []


def test_a_stream_waits_for_its_kv_transfer_no_longer_than_the_prefill_keeps_the_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for a KV transfer's turn had no bound: behind slow transfers a prefilled stream
    was sent to its decode engine after the prefill engine's KV lease (30 s in vLLM) had run out,
    telling it to read KV that was freed. It ends with a 503 (Retry-After) past the limit now."""
    monkeypatch.setattr(disaggregated, "TRANSFER_WAIT_LIMIT_S", 0.4)
    with engines(nixl_prefill, _decode_answers) as (pre, dec):
        config = [entry(pre, "p0", "prefill"), entry(dec, "d0", "decode")]
        gating = (
            "kv_transfer: {order: fifo, max_per_engine: 1}\ndecode_placement: {transfer_tokens_per_s: 50.0}\n"
        )
        routing = profile(tmp_path, mode="conditional", extra=gating)
        with run_gateway(engines=config, routing_profile=routing, monitor_interval_s=60.0) as gw:
            holder = threading.Thread(
                target=httpx.post,
                args=(gw.url + "/v1/chat/completions",),
                kwargs={"json": chat_body(True, max_tokens=8), "timeout": 20},
            )
            holder.start()
            assert wait_until(lambda: len(dec.received) == 1, timeout=10)
            sent = time.monotonic()
            response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(True), timeout=20)
            waited = time.monotonic() - sent
            holder.join()
            assert response.status_code == 503 and response.headers.get("retry-after"), response.text
            assert response.json()["error"]["code"] == "transfer_wait_exceeded" and waited < 1.5, waited
            assert len(dec.received) == 1  # (never sent to read KV that may be gone)


def test_the_wait_for_a_transfer_turn_counts_from_the_prefill_s_answer_not_each_attempt(
    tmp_path: Path,
) -> None:
    """After a decode engine that refused slowly, the next attempt waited another whole limit
    for its turn: past the prefill's KV lease in all."""
    from gateway.fleet.registry import RunningEntry
    from gateway.serving.call import Call
    from policies.decode_placement import DecodeChoice
    from policies.slo import SloSource, SloTarget

    with engines(nixl_prefill, _decode_answers) as (pre, dec):
        config = [entry(pre, "p0", "prefill"), entry(dec, "d0", "decode")]
        gating = "kv_transfer: {order: fifo, max_per_engine: 1}\n"
        routing = profile(tmp_path, mode="conditional", extra=gating)
        with run_gateway(engines=config, routing_profile=routing, monitor_interval_s=60.0) as gw:
            flow = gw.gateway.flow
            assert flow is not None and flow.gate is not None
            request = parse_request("chat", orjson.dumps(chat_body(True)), 16)
            call = Call(
                request, "r", "r", 0.0, None, SloTarget(1.0, 0.1, "c", SloSource.DEFAULT), None, (), {}
            )  # type: ignore[arg-type]
            record = flow.fleet.records["d0"]
            choice = DecodeChoice("d0", 0.01, 0.01, True)

            async def attempt() -> str:
                held = await flow._transfer_turn(call, record, RunningEntry(1, 1, 0.1, 0.0), choice)
                try:  # (the one turn taken: the next attempt waits)
                    waited_from = time.monotonic()
                    try:
                        await flow._transfer_turn(
                            call,
                            record,
                            RunningEntry(1, 1, 0.1, 0.0),
                            choice,
                            kv_until=time.monotonic() - 1.0,
                        )
                    except disaggregated._TransferWaitOver as over:
                        return f"over deadline={over.deadline} after {time.monotonic() - waited_from:.2f} s"
                    return "admitted"
                finally:
                    held()

            loop = gw.server._loop
            assert loop is not None
            outcome = asyncio.run_coroutine_threadsafe(attempt(), loop).result(10)
            assert outcome.startswith("over deadline=False after 0.0"), outcome
            assert flow.gate.waiting("d0") == 0  # (no trace left at the gate)
