"""Request identity over real HTTP: the client's X-Request-Id is correlation only, never a key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.procs import ChildProcess
from tests.gateway.conftest import MODEL, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until

MESSAGES = [{"role": "user", "content": "hello"}]


def _counters(gw: RunningGateway) -> tuple[int, int]:
    fleet, dispatch = gw.gateway.fleet, gw.gateway.dispatch
    assert fleet is not None and dispatch is not None
    return sum(r.in_flight for r in fleet.records.values()), dispatch.core.queued()


def test_two_requests_with_one_client_id_stay_two_requests(two_engines: list[ChildProcess]) -> None:
    """Same id, concurrently, the second queued behind the first: both are served, both get the
    id back, and every counter returns to zero (the id used to be the internal key: in_flight
    stuck at 1, a 500 for the copy, the original hung)."""
    with run_gateway(engines=[engine_entry(two_engines[0])], max_engine_load=1) as gw:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "ignore_eos": True, "stream": True}
        headers = {"X-Request-Id": "same-id"}
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(
                    httpx.post, gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
                )
                for _ in range(3)
            ]
            answers = [f.result() for f in futures]
        assert [r.status_code for r in answers] == [200, 200, 200]
        assert all(r.headers["x-request-id"] == "same-id" for r in answers)
        assert all(r.content.endswith(b"data: [DONE]\n\n") for r in answers)
        assert wait_until(lambda: _counters(gw) == (0, 0), timeout=5), _counters(gw)


def test_a_copy_leaving_the_queue_does_not_touch_the_original(two_engines: list[ChildProcess]) -> None:
    with run_gateway(engines=[engine_entry(two_engines[0])], max_engine_load=1) as gw:
        long = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
        headers = {"X-Request-Id": "dup"}
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", gw.url + "/v1/chat/completions", json=long, headers=headers) as first,
        ):
            chunks = first.iter_bytes()
            next(chunks)
            # the copy queues behind it (no answer at all: not a 4xx/5xx), then its client gives up
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(gw.url + "/v1/chat/completions", json=long, headers=headers, timeout=0.5)
            assert wait_until(lambda: _counters(gw) == (1, 0), timeout=5), _counters(gw)
            rest = b"".join(chunks)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert wait_until(lambda: _counters(gw) == (0, 0), timeout=5), _counters(gw)
