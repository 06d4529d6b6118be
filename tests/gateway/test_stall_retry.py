"""Requests waiting on an engine that stops are tried on another engine once the stall check marks
it, when nothing of their answer has reached the client: a stream that got only its headers, a
plain request still waiting for its answer. Before, they waited out ``first_token_timeout_s``
(600 s by default) or ``request_timeout_s`` for an engine that had stopped (a peer gateway's users
saw one stalled backend hang every request it held).

Two simulated engines run as real processes; one is hung (its steps stop, its HTTP server still
answers, as an engine whose GPU work has stopped), and the gateway's stall check
(``stall_after_s``) finds it."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.procs import ChildProcess, spawn_sim_engine
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.test_migration import capacity_is_released, metric, parse, sim_fault

CHAT = "/v1/chat/completions"
#: the limits a hung engine would otherwise hold a request for: far above what the test allows
LONG_S = 60.0
#: how long the test allows: the stall check's second and its rounds, and the answer elsewhere
ALLOWED_S = 15.0


@pytest.fixture(scope="module")
def engines() -> Iterator[list[ChildProcess]]:
    with spawn_sim_engine(*SIM_ARGS, name="s0") as s0, spawn_sim_engine(*SIM_ARGS, name="s1") as s1:
        yield [s0, s1]


@pytest.fixture()
def hung(engines: list[ChildProcess]) -> Iterator[list[ChildProcess]]:
    """The engines with the first one hung; revived after the test."""
    sim_fault(engines[0], {"mode": "hang"})
    try:
        yield engines
    finally:
        for engine in engines:
            sim_fault(engine, {"clear": True})


def gateway(engines: list[ChildProcess], **settings: Any) -> Any:
    limits = {name: LONG_S for name in ("first_token_timeout_s", "headers_timeout_s", "request_timeout_s")}
    return run_gateway(
        engines=[engine_entry(e) for e in engines],
        monitor_interval_s=0.2,
        stall_after_s=1.0,
        idle_timeout_s=LONG_S,
        **{**limits, **settings},
    )


def body(stream: bool, tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a request on a hung engine"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def text_of(stream: bool, r: httpx.Response) -> str:
    if stream:
        got = parse(r.status_code, "", r.content)
        assert got.error is None and got.done, (got.error, r.content[-300:])
        return got.text
    return str(r.json()["choices"][0]["message"]["content"])


def concurrently(gw: RunningGateway, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """``bodies`` sent at once (least load spreads them over both engines)."""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(httpx.post, gw.url + CHAT, json=b, timeout=LONG_S + 30) for b in bodies]
        return [f.result() for f in futures]


@pytest.mark.parametrize(
    ("stream", "migration_limit"),
    [(True, 0), (True, 2), (False, 0)],
    ids=["stream", "stream-that-may-migrate", "plain"],
)
def test_requests_on_a_stalled_engine_are_served_elsewhere_at_once(
    hung: list[ChildProcess], stream: bool, migration_limit: int
) -> None:
    """Four requests at once, two on the hung engine: every one is answered whole within seconds.
    A stream that may migrate has not started either (no event: nothing to resume from), so it
    is tried again as any other; a plain request never had its answer's headers."""
    reference = httpx.post(hung[1].url + CHAT, json=body(stream, 30), timeout=30)
    expected = text_of(stream, reference)
    with gateway(hung, migration_limit=migration_limit) as gw:
        # (the registry is the process's: counted from here)
        retries = metric(gw, "slogate_upstream_retries_total", reason="stalled")
        errors = metric(gw, "slogate_upstream_errors_total", engine="s0", kind="stalled")
        stalls = metric(gw, "slogate_migrations_total", reason="stall")
        started = time.monotonic()
        answers = concurrently(gw, [body(stream, 30)] * 4)
        took = time.monotonic() - started
        assert [r.status_code for r in answers] == [200] * 4, [r.text[:300] for r in answers]
        assert [text_of(stream, r) for r in answers] == [expected] * 4
        assert took < ALLOWED_S, took
        # (the two on the hung engine: each tried once more, elsewhere)
        assert metric(gw, "slogate_upstream_retries_total", reason="stalled") == retries + 2
        assert metric(gw, "slogate_upstream_errors_total", engine="s0", kind="stalled") == errors + 2
        assert metric(gw, "slogate_migrations_total", reason="stall") == stalls
        if stream:
            # their headers went out from the hung engine, once: the events are the other's
            assert sorted(r.headers["x-slogate-engine"] for r in answers) == ["s0", "s0", "s1", "s1"]
        fleet = gw.gateway.fleet
        assert fleet is not None
        # emptied, it would look idle and come back at the next check while still hung
        assert fleet.records["s0"].tripped
        assert wait_until(lambda: capacity_is_released(gw), timeout=5)


def test_a_stream_whose_retry_cannot_be_placed_ends_with_an_error_event(hung: list[ChildProcess]) -> None:
    """One attempt only: a stream cut from the hung engine after its headers went out has no
    other attempt, so the client is told in the stream (an error event and [DONE]), at once."""
    with gateway(hung, dispatch_attempts=1) as gw:
        started = time.monotonic()
        answers = concurrently(gw, [body(True, 20)] * 2)
        took = time.monotonic() - started
        assert [r.status_code for r in answers] == [200, 200]
        streams = sorted(
            (parse(r.status_code, "", r.content) for r in answers), key=lambda s: s.error is None
        )
        failed, whole = streams
        assert whole.error is None and whole.done and whole.text
        assert failed.error is not None and failed.done and not failed.text, failed
        assert "stalled before it answered" in failed.error["message"], failed.error
        assert took < ALLOWED_S, took
        assert wait_until(lambda: capacity_is_released(gw), timeout=5)


def test_an_engine_that_would_stay_in_rotation_keeps_its_requests(hung: list[ChildProcess]) -> None:
    """With ejections off, the hung engine emptied of its requests would be back in rotation at
    the next check and hold each new one for stall_after_s again: what it holds keeps its own
    limits (here a 3 s first-token limit) and it stays out of rotation for the stall meanwhile."""
    with gateway(hung, outlier_consecutive_failures=0, first_token_timeout_s=3.0) as gw:
        retries = metric(gw, "slogate_upstream_retries_total", reason="stalled")
        fleet = gw.gateway.fleet
        assert fleet is not None
        seen_stalled: list[bool] = []
        with concurrent.futures.ThreadPoolExecutor(1) as watch:
            watching = watch.submit(
                lambda: seen_stalled.append(wait_until(lambda: fleet.records["s0"].stalled, 5))
            )
            answers = concurrently(gw, [body(True, 20)] * 2)
            watching.result()
        assert seen_stalled == [True]  # (out of rotation for the stall while it held the stream)
        streams = [parse(r.status_code, r.headers.get("x-slogate-engine", ""), r.content) for r in answers]
        held = [s for s in streams if s.engine == "s0"]
        assert len(held) == 1 and held[0].error is not None, streams
        assert "sent no first token" in held[0].error["message"]
        assert all(s.error is None and s.done for s in streams if s.engine == "s1")
        assert metric(gw, "slogate_upstream_retries_total", reason="stalled") == retries
        assert not fleet.records["s0"].tripped
        assert wait_until(lambda: capacity_is_released(gw), timeout=5)
