"""Sleep/wake, weight loading, failure injection and client-disconnect aborts over HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.sim.helpers import MODEL
from tests.sim.test_http_api import metric, post, stream
from tests.support.sim_process import SimProcess, start_sim_engine

SCALE = 20.0


@pytest.fixture
def fresh() -> Iterator[SimProcess]:
    """A qwen-7b engine 20x faster than real time, one per test (faults change its state)."""
    with start_sim_engine("--profile", "qwen-7b", "--model", MODEL, "--time-scale", str(SCALE)) as proc:
        yield proc


async def call(method: str, url: str, **kw: object) -> tuple[int, object, float]:
    start = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:  # type: ignore[arg-type]
        body = await r.json(content_type=None) if await r.read() else None
        return r.status, body, time.perf_counter() - start


async def test_sleep_and_wake(fresh: SimProcess) -> None:
    url = fresh.url
    status, body, _ = await call("POST", url + "/sleep?level=1")
    assert status == 200 and body == {"status": "sleeping", "level": 1}
    assert (await call("GET", url + "/is_sleeping"))[1] == {"is_sleeping": True}
    assert await metric(url, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1.0
    # a request sent while asleep waits, then runs after wake-up
    pending = asyncio.create_task(post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    await asyncio.sleep(0.2)
    assert not pending.done()
    status, body, _ = await call("POST", url + "/wake_up?tags=kv_cache")
    assert body == {"status": "sleeping", "tags": ["kv_cache"]}  # partial wake
    status, body, seconds = await call("POST", url + "/wake_up")
    assert body["status"] == "awake" and seconds >= 2.73 / SCALE  # weights back from CPU (Table 2)
    assert (await call("GET", url + "/is_sleeping"))[1] == {"is_sleeping": False}
    assert (await pending)[0] == 200
    assert await metric(url, "vllm:engine_sleep_state", sleep_state="awake") == 1.0
    assert (await call("POST", url + "/sleep?level=7"))[0] == 400


async def test_sleep_abort_ends_in_flight_requests(fresh: SimProcess) -> None:
    task = asyncio.create_task(
        stream(fresh.url + "/v1/completions", {"prompt": "x", "max_tokens": 500, "ignore_eos": True})
    )
    await asyncio.sleep(0.2)
    await call("POST", fresh.url + "/sleep?level=2&mode=abort")
    events, _, _ = await task
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert await metric(fresh.url, "vllm:engine_sleep_state", sleep_state="discard_all") == 1.0
    _, _, seconds = await call("POST", fresh.url + "/wake_up")
    assert seconds >= 4.14 / SCALE  # level 2 reloads from disk


async def test_a_lighter_sleep_after_a_deeper_one_keeps_the_weights_off(fresh: SimProcess) -> None:
    """Level 1, then level 0: the second replaced what slept with the scheduler alone, and the wake
    skipped loading weights that were still offloaded (sleep experiments came out optimistic)."""
    await call("POST", fresh.url + "/sleep?level=1")
    status, _, _ = await call("POST", fresh.url + "/sleep?level=0")
    assert status == 200
    _, body, seconds = await call("POST", fresh.url + "/wake_up")
    assert body["status"] == "awake" and seconds >= 2.73 / SCALE  # weights back from CPU


@pytest.mark.parametrize(("source", "seconds"), [("disk", 4.14), ("cpu", 2.73), ("peer", 0.89)])
async def test_load_weights_takes_table2_time(fresh: SimProcess, source: str, seconds: float) -> None:
    payload = {"source": source} | ({"peer_url": "http://127.0.0.1:1"} if source == "peer" else {})
    status, body, elapsed = await call("POST", fresh.url + "/sim/load_weights", json=payload)
    assert status == 200 and body["seconds"] == pytest.approx(seconds, abs=0.01)  # type: ignore[index]
    assert elapsed == pytest.approx(seconds / SCALE, rel=0.2, abs=0.02)


async def test_crash_fault_cuts_streams_and_fails_health(fresh: SimProcess) -> None:
    with pytest.raises(aiohttp.ClientPayloadError):
        await stream(
            fresh.url + "/v1/completions",
            {"prompt": "x", "max_tokens": 50, "ignore_eos": True},
            headers={"X-Sim-Fault": "crash-after=3"},
        )
    assert (await call("GET", fresh.url + "/health"))[0] == 503
    status, _, _ = await call("POST", fresh.url + "/v1/completions", json={"prompt": "x"})
    assert status == 503
    await call("POST", fresh.url + "/sim/fault", json={"clear": True})
    assert (await call("GET", fresh.url + "/health"))[0] == 200
    await call("POST", fresh.url + "/sim/fault", json={"mode": "crash"})
    assert (await call("GET", fresh.url + "/health"))[0] == 503


async def test_hang_and_slow_faults(fresh: SimProcess) -> None:
    url = fresh.url + "/v1/completions"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(
            post(url, {"prompt": "x", "max_tokens": 2}, headers={"X-Sim-Fault": "hang"}), 0.5
        )
    body = {"prompt": "y", "max_tokens": 21, "ignore_eos": True}

    async def decode_s() -> float:
        _, times, _ = await stream(url, body)
        return times[-1] - times[0]

    # (the fastest of 3 each: a stall of the VM only lengthens a stream, and one in a base stream
    # would hide the slowdown as one in a slowed stream would fake it)
    base = min([await decode_s() for _ in range(3)])
    await call("POST", fresh.url + "/sim/fault", json={"mode": "slow", "factor": 4})
    slow = min([await decode_s() for _ in range(3)])
    assert slow > 3 * base, (slow, base)
    await call("POST", fresh.url + "/sim/fault", json={"mode": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(url, {"prompt": "z", "max_tokens": 2}), 0.5)
    await call("POST", fresh.url + "/sim/fault", json={"clear": True})
    assert (await post(url, {"prompt": "z", "max_tokens": 2}))[0] == 200
    assert (await call("POST", fresh.url + "/sim/fault", json={"mode": "explode"}))[0] == 400


async def test_client_disconnect_aborts_and_frees_blocks(fresh: SimProcess) -> None:
    url = fresh.url
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            url + "/v1/completions",
            json={"prompt": list(range(300, 800)), "max_tokens": 5000, "ignore_eos": True, "stream": True},
        )
        await resp.content.readline()
        assert await metric(url, "vllm:num_requests_running") == 1
        assert await metric(url, "vllm:kv_cache_usage_perc") > 0
        resp.close()  # drop the connection mid-stream
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and await metric(url, "vllm:num_requests_running") != 0:
        await asyncio.sleep(0.05)
    assert await metric(url, "vllm:num_requests_running") == 0
    assert await metric(url, "vllm:kv_cache_usage_perc") == 0.0
    # a client leaving is no error of the engine's (it once logged a traceback for each)
    assert "Error handling request" not in fresh.stderr() and "Traceback" not in fresh.stderr()
    # a non-streamed request abandoned by its client is aborted too
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(
            post(url + "/v1/completions", {"prompt": "q", "max_tokens": 5000, "ignore_eos": True}), 0.3
        )
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and await metric(url, "vllm:num_requests_running") != 0:
        await asyncio.sleep(0.05)
    assert await metric(url, "vllm:num_requests_running") == 0


def test_sigterm_lets_an_open_stream_finish_and_exits_at_once() -> None:
    """On SIGTERM the engine stepped no more (its driver was cancelled first): an open stream
    froze until aiohttp's shutdown timeout cut it, about two minutes later."""
    import signal

    import httpx

    with start_sim_engine("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "1") as engine:
        events, done = 0, False
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=8) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if events == 2:
                    engine.process.send_signal(signal.SIGTERM)
                done = done or line == "data: [DONE]"
        assert done and events == 41 + 1  # every token, then [DONE]
        assert engine.process.wait(30) == 0


async def test_a_sleep_that_waits_for_requests_a_paused_engine_cannot_finish_answers_at_once(
    fresh: SimProcess,
) -> None:
    """Paused (level 0, requests kept), the engine's running stream never ends: a sleep with
    mode=wait waited for it for good, admitting no new request meanwhile."""
    task = asyncio.create_task(
        stream(fresh.url + "/v1/completions", {"prompt": "x", "max_tokens": 500, "ignore_eos": True})
    )
    await asyncio.sleep(0.2)
    assert (await call("POST", fresh.url + "/sleep?level=0&mode=keep"))[0] == 200
    status, body, seconds = await call(
        "POST", fresh.url + "/sleep?level=1&mode=wait", timeout=aiohttp.ClientTimeout(total=5)
    )
    assert status == 409 and "paused" in body["error"]["message"] and seconds < 1  # type: ignore[index]
    # it admits and serves again once awake, and the kept stream goes on to its end
    assert (await call("POST", fresh.url + "/wake_up"))[0] == 200
    assert (await post(fresh.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}))[0] == 200
    events, _, _ = await asyncio.wait_for(task, 30)
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_a_sleep_during_a_wake_up_s_weight_load_is_not_undone_by_it(fresh: SimProcess) -> None:
    """The wake-up ended its modelled weight load by clearing the sleep state and unpausing the
    engine, whatever had happened meanwhile: a sleep asked for during it was lost."""
    assert (await call("POST", fresh.url + "/sleep?level=2"))[0] == 200
    waking = asyncio.create_task(call("POST", fresh.url + "/wake_up"))  # (4.14 s / 20 of disk load)
    await asyncio.sleep(0.05)
    status, _, _ = await call("POST", fresh.url + "/sleep?level=1")
    assert status == 200 and (await waking)[0] == 200
    assert (await call("GET", fresh.url + "/is_sleeping"))[1] == {"is_sleeping": True}
    # asleep: a request waits until the engine is woken
    pending = asyncio.create_task(post(fresh.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    await asyncio.sleep(0.2)
    assert not pending.done()
    assert (await call("POST", fresh.url + "/wake_up"))[0] == 200
    assert (await asyncio.wait_for(pending, 10))[0] == 200
