"""Review tests for the P/D disaggregation flow (gateway/serving/disaggregated.py and friends).

Each test pins one defect found in review; they fail against the code as reviewed. They use stub
engines (kind ``openai``) in threads, so the engine behaviour that matters is explicit:

- an SGLang-style decode engine sends its stream's headers at once and only then waits for the
  KV (Starlette's StreamingResponse does so), which the simulated engine does not;
- a non-streamed decode answer shows the gateway no first token;
- a decode engine that refuses before any byte.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway import metrics
from tests.gateway.conftest import MODEL, free_port
from tests.gateway.gateway_thread import run_gateway, wait_until
from tests.gateway.stub_engines import StubEngine, completion_body, events_every, never_answer, status_after

LONG = "tell me about the weather in the hills " * 60
#: what a vLLM NIXL prefill answers (kv_transfer_params to hand to the decode verbatim)
KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "p-engine",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def profile(tmp_path: Path, mode: str = "always", extra: str = "") -> str:
    path = tmp_path / f"pd-review-{mode}.yaml"
    path.write_text(
        "name: pd-review\nfilters: []\nscorers:\n  - name: least_load\n    weight: 1.0\n"
        "picker:\n  name: max_score\n"
        f"disaggregation: {{mode: {mode}, min_prompt_tokens: 256}}\n{extra}"
    )
    return str(path)


def entry(engine: StubEngine, name: str, role: str, **extra: object) -> dict[str, object]:
    return {**engine.entry(name), "role": role, **extra}


def chat_body(stream: bool, content: str = LONG, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }
    if stream:
        body["stream"] = True
    return body


async def nixl_prefill(_: StubEngine, request: web.Request) -> web.StreamResponse:
    """A vLLM prefill engine: answers at once with the KV handover params."""
    answer = orjson.loads(completion_body("x"))
    answer["kv_transfer_params"] = KV_PARAMS
    return web.json_response(answer)


@contextmanager
def engines(*behaviours: Any) -> Iterator[list[StubEngine]]:
    with ExitStack() as stack:
        yield [stack.enter_context(StubEngine(b)) for b in behaviours]


# -- 1. bootstrap: a failed prefill leaves a streamed decode waiting for KV (aibrix#2289) -----------


async def headers_then_wait_for_kv(engine: StubEngine, request: web.Request) -> web.StreamResponse:
    """An SGLang decode engine: the stream's headers go out at once, then it waits for KV that
    the (failed) prefill will never send."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await engine.wait_forever()
    return response


def test_bootstrap_failed_prefill_closes_a_streamed_decode_whose_headers_came(tmp_path: Path) -> None:
    """disaggregated.py:448 only closes the decode when ``call.overhead_s < 0``, i.e. before the
    client's headers went out; a streamed decode's headers go out as soon as the decode engine
    answers its headers (before any token, before any KV). The decode then waits for KV that
    is not coming until first_token_timeout_s (default 600 s) and holds its reservation."""
    with engines(status_after(500, 0.3), headers_then_wait_for_kv) as (prefill, decode):
        config = [
            entry(prefill, "p0", "prefill", kv_transfer="bootstrap", bootstrap_port=8998),
            entry(decode, "d0", "decode"),
        ]
        with run_gateway(engines=config, routing_profile=profile(tmp_path), first_token_timeout_s=30.0) as gw:
            started = time.monotonic()
            ended_in_time = True
            try:
                with httpx.stream(
                    "POST", gw.url + "/v1/chat/completions", json=chat_body(True), timeout=6.0
                ) as response:
                    response.read()
            except httpx.ReadTimeout:
                ended_in_time = False
            elapsed = time.monotonic() - started
            assert len(prefill.received) == 1 and len(decode.received) == 1  # both sent together
            assert ended_in_time, (
                f"the client's stream was still open {elapsed:.1f} s after its prefill failed "
                "(at 0.3 s): the decode was left waiting for KV"
            )
            assert wait_until(lambda: decode.aborted == 1, timeout=2.0), "the decode request was not closed"
            fleet = gw.gateway.fleet
            assert fleet is not None
            assert wait_until(lambda: not fleet.records["d0"].running, timeout=2.0)


def test_bootstrap_client_leaving_while_both_engines_work_closes_both_and_releases_them(
    tmp_path: Path,
) -> None:
    """The client leaves while the prefill still runs and the decode waits for its KV: the
    handler is cancelled, and the clean-up awaited the prefill's cancellation first, which
    re-raised the handler's own cancellation at once: the decode ran on without an owner and
    its reservation stayed counted on the decode engine."""

    async def slow_prefill(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(3.0)
        return await nixl_prefill(engine, request)

    with engines(slow_prefill, headers_then_wait_for_kv) as (prefill, decode):
        config = [
            entry(prefill, "p0", "prefill", kv_transfer="bootstrap", bootstrap_port=8998),
            entry(decode, "d0", "decode"),
        ]
        with run_gateway(engines=config, routing_profile=profile(tmp_path), first_token_timeout_s=60.0) as gw:
            with (
                pytest.raises(httpx.ReadTimeout),
                httpx.stream(
                    "POST", gw.url + "/v1/chat/completions", json=chat_body(True), timeout=0.8
                ) as response,
            ):
                response.read()
            fleet = gw.gateway.fleet
            assert fleet is not None
            assert wait_until(lambda: not fleet.records["d0"].running, timeout=3.0), "decode still reserved"
            assert wait_until(lambda: not fleet.records["p0"].running, timeout=3.0), "prefill still reserved"
            assert wait_until(lambda: decode.aborted == 1, timeout=3.0), "the decode request was not closed"


# -- 2. the KV-transfer gate holds a non-streamed decode's turn for its whole answer ---------------


def test_non_streamed_decode_does_not_hold_its_kv_turn_for_the_whole_answer(tmp_path: Path) -> None:
    """transfer_gate's turn ends at the decode's first token (RunningEntry.on_prefilled) or at the
    end of the decode stage; a non-streamed answer never reports a first token (read_plain does
    not call mark_prefilled), so the turn lasts the whole generation: with max_per_engine N, at
    most N non-streamed requests decode on a decode engine at once."""
    arrivals: list[float] = []

    async def slow_plain_decode(_: StubEngine, request: web.Request) -> web.StreamResponse:
        arrivals.append(time.monotonic())
        await asyncio.sleep(2.0)  # a long generation; its KV arrived long ago
        return web.Response(body=completion_body("ok"), content_type="application/json")

    gating = "kv_transfer: {order: fifo, max_per_engine: 1}\n"
    with engines(nixl_prefill, slow_plain_decode) as (prefill, decode):
        config = [entry(prefill, "p0", "prefill"), entry(decode, "d0", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path, extra=gating)) as gw:
            with ThreadPoolExecutor(2) as pool:
                futures = [
                    pool.submit(
                        httpx.post, gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20
                    )
                    for _ in range(2)
                ]
                statuses = [f.result().status_code for f in futures]
            assert statuses == [200, 200]
            assert len(arrivals) == 2
            gap = arrivals[1] - arrivals[0]
            assert gap < 1.0, (
                f"the second decode reached the decode engine {gap:.1f} s after the first: it waited "
                "at the transfer gate for the first one's whole answer"
            )


# -- 3. a decode engine that refuses: re-prefill, then a misleading 'no decode engine' ------------


def test_decode_refusal_is_reported_not_replaced_by_no_decode_engine(tmp_path: Path) -> None:
    """The decode stage returns the decode engine's retryable error to CollocatedFlow.serve, which
    places a *new prefill* on another prefill engine; that attempt's decode stage excludes every
    decode engine already tried (progress.decode_tried) and answers 'no decode engine ... in
    rotation', which becomes the client's error. The prefill is wasted (its KV stays held on the
    prefill engine for its lease) and the real cause is lost."""
    with engines(nixl_prefill, nixl_prefill, status_after(503, 0.0)) as (p0, p1, decode):
        config = [entry(p0, "p0", "prefill"), entry(p1, "p1", "prefill"), entry(decode, "d0", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path)) as gw:
            response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20)
            assert response.status_code >= 500
            message = response.json()["error"]["message"]
            prefills = len(p0.received) + len(p1.received)
            problems = []
            if "no decode engine" in message:
                problems.append(f"the client was told {message!r}, not the decode engine's 503")
            if prefills != 1:
                problems.append(f"{prefills} prefills for one request (the later ones wasted)")
            assert not problems, "; ".join(problems)


# -- 4. the admin role flip answers 500 to a body whose role is not hashable -----------------------


def test_admin_role_flip_with_unhashable_role_is_a_400(tmp_path: Path) -> None:
    """app.py: ``body.get("role") not in {r.value for r in Role}`` raises TypeError for a list or
    an object, which is not a GatewayError: an internal error instead of a 400."""
    with engines(nixl_prefill, nixl_prefill) as (prefill, decode):
        config = [entry(prefill, "p0", "prefill"), entry(decode, "d0", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path)) as gw:
            for role in (["decode"], {"decode": 1}):
                r = httpx.post(gw.url + "/admin/engines/p0/role", json={"role": role}, timeout=10)
                assert r.status_code == 400, (role, r.status_code, r.text)


# -- 5. a client's own KV handover fields reach decode engines -------------------------------------


@pytest.mark.parametrize(
    "smuggled",
    [
        {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600}},
        {"kv_transfer_params": {"do_remote_decode": True}},
        {"bootstrap_host": "10.9.9.9", "bootstrap_port": 8998, "bootstrap_room": 7},
    ],
)
def test_client_kv_handover_fields_never_reach_an_engine(tmp_path: Path, smuggled: dict[str, Any]) -> None:
    """A short prompt runs whole on a decode engine with the client's body as sent: client-made
    ``kv_transfer_params`` / ``bootstrap_*`` make the engine pull KV from a host the client
    chose, or (do_remote_decode) hold its KV blocks for the lease as a prefill would."""
    with engines(nixl_prefill, status_after(200, 0.0)) as (prefill, decode):
        config = [entry(prefill, "p0", "prefill"), entry(decode, "d0", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path, "conditional")) as gw:
            httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False, "hi", **smuggled), timeout=20)
            assert decode.received, "the short prompt did not reach the decode engine"
            leaked = sorted(set(smuggled) & set(decode.received[-1]))
            assert not leaked, f"client-supplied {leaked} forwarded to the decode engine"


class _CompletionsStub(StubEngine):
    """A stub that also serves /v1/completions (a batch of prompts goes there)."""

    async def build(self) -> web.Application:
        app = await super().build()

        async def completions(request: web.Request) -> web.StreamResponse:
            self.received.append(await request.json())
            return await self.behaviour(self, request)

        app.router.add_post("/v1/completions", completions)
        return app


def _batch_answer(kv: bool) -> web.Response:
    body: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": i, "text": "x", "finish_reason": "length"} for i in range(2)],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    if kv:
        body["kv_transfer_params"] = KV_PARAMS  # vLLM: the first prompt's only
    return web.Response(body=orjson.dumps(body), content_type="application/json")


@pytest.mark.parametrize("mode", ["conditional", "always"])
def test_a_completions_batch_is_never_handed_over_as_one_sequence(tmp_path: Path, mode: str) -> None:
    """A batch of prompts was prefilled on the prefill engine and the decode engine was given the
    first prompt's KV for both (vLLM answers a batch's prefill with one kv_transfer_params)."""

    async def prefill(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return _batch_answer(True)

    async def decode(_: StubEngine, request: web.Request) -> web.StreamResponse:
        return _batch_answer(False)

    with _CompletionsStub(prefill) as p, _CompletionsStub(decode) as d:
        config = [entry(p, "p0", "prefill"), entry(d, "d0", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path, mode)) as gw:
            body = {"model": MODEL, "prompt": [LONG, LONG + " and the sea"], "max_tokens": 8}
            answer = httpx.post(gw.url + "/v1/completions", json=body, timeout=20)
    assert not p.received
    if mode == "always":  # it may not run whole on a decode engine either
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", answer.text
        assert not d.received
    else:
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 2, answer.text
        assert [b.get("kv_transfer_params") for b in d.received] == [None]


def test_bootstrap_prefill_failure_is_retried_with_the_same_healthy_decode_engine(tmp_path: Path) -> None:
    """A failed bootstrap prefill cancels its decode (the KV will not come) and is retried on the
    next prefill engine; the cancelled decode engine was left out of that retry, so with one
    decode engine the client got 503 "no decode engine" though nothing was wrong with it."""
    prefills = 0
    prefilled = threading.Event()

    async def first_prefill_fails(_: StubEngine, request: web.Request) -> web.StreamResponse:
        nonlocal prefills
        prefills += 1  # (whichever prefill engine is placed first fails)
        if prefills == 1:
            return web.json_response({"error": {"message": "prefill crashed", "code": 500}}, status=500)
        prefilled.set()
        return web.Response(body=completion_body("x"), content_type="application/json")

    async def decode(_: StubEngine, request: web.Request) -> web.StreamResponse:
        # waits for the KV: until a prefill has succeeded (the failed one's decode is cancelled)
        for _ in range(400):
            if prefilled.is_set():
                break
            await asyncio.sleep(0.025)
        return web.Response(body=completion_body("the answer"), content_type="application/json")

    with engines(first_prefill_fails, first_prefill_fails, decode) as (p0, p1, d):
        boot = {"kv_transfer": "bootstrap", "bootstrap_port": 8998}
        config = [
            entry(p0, "p0", "prefill", **boot),
            entry(p1, "p1", "prefill", **boot),
            entry(d, "d0", "decode"),
        ]
        with run_gateway(engines=config, routing_profile=profile(tmp_path, "always")) as gw:
            answer = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20)
    assert answer.status_code == 200, answer.text
    # two prefills (the failed one retried) and the answer from d0, the only decode engine (left
    # out of the retry, the client got a 503). The cancelled first decode reaches d0 or not,
    # as the failure races it (a loaded machine sent it after the cancellation once)
    assert len(p0.received) + len(p1.received) == 2 and 1 <= len(d.received) <= 2


@pytest.mark.parametrize(
    ("cut", "expected", "decodes"), [(True, 502, 1), (False, 200, 2)], ids=["cut", "refused"]
)
def test_a_decode_cut_after_it_began_its_answer_is_not_retried_with_the_same_kv(
    tmp_path: Path, cut: bool, expected: int, decodes: int
) -> None:
    """A non-streamed decode that began its answer had read the KV (the prefill engine may have
    freed it since); retried on another decode engine with the same kv_transfer_params, that one
    would decode from KV that is gone. A decode engine that refuses before answering is retried."""
    calls = 0

    async def first_fails(_: StubEngine, request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1  # (both decode engines share it: whichever is placed first fails)
        if calls > 1:
            return web.Response(body=completion_body("fine"), content_type="application/json")
        if not cut:
            return web.json_response({"error": {"message": "busy", "code": 503}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "500"})
        await response.prepare(request)
        await response.write(b'{"id": "cmpl-1", "choi')
        assert request.transport is not None
        request.transport.close()  # the engine died mid-answer
        return response

    with engines(nixl_prefill, first_fails, first_fails) as (p, d0, d1):
        config = [entry(p, "p0", "prefill"), entry(d0, "d0", "decode"), entry(d1, "d1", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path)) as gw:
            response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(False), timeout=20)
    assert response.status_code == expected, response.text
    assert calls == decodes and len(d0.received) + len(d1.received) == decodes
    assert len(p.received) == 1


def test_a_bootstrap_decode_waiting_for_its_prefill_is_not_taken_for_a_stalled_engine(tmp_path: Path) -> None:
    """With SGLang's bootstrap the decode request goes out with the prefill and can show nothing
    before the prefill's KV arrives: its stall clock starts when the prefill answers
    (``ready_at``), not when it was sent. Counted from the send, a prefill longer than
    ``stall_after_s`` took a healthy decode engine out of rotation for it."""
    prefill_s, stall_s = 2.0, 0.8
    prefilled = threading.Event()

    async def slow_prefill(_: StubEngine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(prefill_s)
        prefilled.set()
        return web.Response(body=completion_body("x"), content_type="application/json")

    async def decode_after_kv(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        for _ in range(400):  # the KV comes when the prefill is done
            if prefilled.is_set():
                break
            await asyncio.sleep(0.01)
        return await events_every(0.05, 3)(engine, request)

    with engines(slow_prefill, decode_after_kv, decode_after_kv) as (p, d0, d1):
        config = [
            entry(p, "p0", "prefill", kv_transfer="bootstrap", bootstrap_port=8998),
            entry(d0, "d0", "decode"),
            entry(d1, "d1", "decode"),
        ]
        with run_gateway(
            engines=config, routing_profile=profile(tmp_path), monitor_interval_s=0.05, stall_after_s=stall_s
        ) as gw:
            fleet = gw.gateway.fleet
            assert fleet is not None
            stalled: set[str] = set()
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(
                    httpx.post, gw.url + "/v1/chat/completions", json=chat_body(True), timeout=20
                )
                while not answer.done():
                    stalled.update(e for e in ("d0", "d1") if fleet.records[e].stalled)
                    time.sleep(0.01)
            response = answer.result()
            assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
            assert len(d0.received) + len(d1.received) == 1
    assert not stalled, f"{stalled} taken out of rotation while its decode waited for a {prefill_s} s prefill"


def test_a_bootstrap_prefill_failing_after_the_stream_began_is_counted_once(tmp_path: Path) -> None:
    """The decode's stream had begun (its headers went out) when the prefill engine refused: the
    client's stream ends with an error event, and the prefill's failure was counted twice in
    slogate_upstream_errors, as the refusal it was (status) and again as a cut stream."""

    async def refusing_prefill(_: StubEngine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)  # (the decode's headers reach the client first)
        return web.json_response({"error": {"message": "prefill crashed", "code": 500}}, status=500)

    def errors(kind: str) -> float:
        return (
            metrics.REGISTRY.get_sample_value(
                "slogate_upstream_errors_total", {"engine": "p-refusing", "kind": kind}
            )
            or 0.0
        )

    with engines(refusing_prefill, headers_then_wait_for_kv) as (p, d):
        boot = {"kv_transfer": "bootstrap", "bootstrap_port": 8998}
        config = [entry(p, "p-refusing", "prefill", **boot), entry(d, "d-waiting", "decode")]
        with run_gateway(engines=config, routing_profile=profile(tmp_path, "always")) as gw:
            before = {kind: errors(kind) for kind in ("status", "stream_cut")}
            answer = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(True), timeout=20)
            after = {kind: errors(kind) for kind in ("status", "stream_cut")}
    assert answer.status_code == 200 and '"error"' in answer.text and "prefill" in answer.text
    assert answer.text.rstrip().endswith("data: [DONE]")
    assert after["status"] - before["status"] == 1 and after["stream_cut"] == before["stream_cut"]


def test_a_collocated_engine_that_timed_out_with_the_request_is_not_re_run_on_a_decode_engine(
    tmp_path: Path,
) -> None:
    """A P/D model's front pool with a collocated engine, which serves a request whole: it took a
    streamed request and sent no headers in time. The collocated flow never retries that (the
    engine had the request), but the P/D fallback ran it whole again on a decode engine."""
    dead = f"http://127.0.0.1:{free_port()}"  # the prefill engine: down, so the collocated one is placed
    with engines(never_answer, status_after(200, 0.0)) as (c, d):
        config = [
            c.entry("c-silent"),
            {"url": dead, "kind": "openai", "model": MODEL, "name": "p-down", "role": "prefill"},
            entry(d, "d-ready", "decode"),
        ]
        settings = {"monitor_interval_s": 0.1, "headers_timeout_s": 0.5}
        with run_gateway(engines=config, routing_profile=profile(tmp_path, "conditional"), **settings) as gw:
            assert wait_until(lambda: not gw.gateway.fleet.records["p-down"].healthy, timeout=5.0)
            answer = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(True), timeout=20)
    assert c.received, "the collocated engine was never placed: the test proves nothing"
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "upstream_timeout", answer.text
    assert not d.received
