"""SLO classification, queueing, shedding and engine-side priority through the live gateway."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.engines.vllm import parse_vllm_metrics
from gateway.procs import ChildProcess, spawn_sim_engine
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def engine() -> Iterator[ChildProcess]:
    with spawn_sim_engine(*SIM_ARGS, name="e0") as e:
        yield e


@pytest.fixture(scope="module")
def gw(engine: ChildProcess) -> Iterator[RunningGateway]:
    with run_gateway(engines=[engine_entry(engine)], slo_profile="hyperflexis-4task") as running:
        yield running


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-slo-task": "medical_qa"}, ("medical_qa", "700", "500")),
        ({"x-slo-task": "wikisql"}, ("wikisql", "20000", "1000")),
        ({"x-slo-task": "wikisql", "x-slo-ttft-ms": "250"}, ("wikisql", "250", "1000")),
        ({"x-slo-ttft-ms": "300", "x-slo-tpot-ms": "40"}, ("default", "300", "40")),
        ({"x-slo-task": "no-such-task"}, ("default", "1500", "800")),
        ({}, ("default", "1500", "800")),
    ],
)
def test_class_and_targets_are_echoed(
    gw: RunningGateway, headers: dict[str, str], expected: tuple[str, ...]
) -> None:
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, headers=headers)
    assert r.status_code == 200
    assert (r.headers["x-slo-class"], r.headers["x-slo-ttft-ms"], r.headers["x-slo-tpot-ms"]) == expected


def test_priority_profile_maps_priorities_to_bounded_targets(engine: ChildProcess) -> None:
    with run_gateway(engines=[engine_entry(engine)], slo_profile="priority") as gw:
        ttft = {}
        for p in (0, 3):
            r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, headers={"x-priority": str(p)})
            assert r.headers["x-slo-class"] == f"p{p}"
            ttft[p] = int(r.headers["x-slo-ttft-ms"])
        assert 525 <= ttft[0] <= 875 and ttft[3] <= 25000
        for p in (1, 0):  # the body's priority, 0 included (the most urgent level, as the header's)
            body_priority = httpx.post(gw.url + "/v1/chat/completions", json={**BODY, "priority": p})
            assert body_priority.status_code == 200 and body_priority.headers["x-slo-class"] == f"p{p}"
        none = httpx.post(gw.url + "/v1/chat/completions", json=BODY)
        assert none.status_code == 200 and none.headers["x-slo-class"] != "p0"


def test_priority_reaches_the_mapper_and_pending_counts_return_to_zero(engine: ChildProcess) -> None:
    with run_gateway(engines=[engine_entry(engine)], slo_profile="priority") as gw:
        slo = gw.gateway.slo
        stream_body = {**BODY, "stream": True, "max_tokens": 6, "ignore_eos": True}
        for headers, body in (
            ({"x-priority": "2"}, stream_body),  # header only: must be filed as P2, not P0
            ({"x-priority": "2"}, BODY),  # non-streamed successes must leave the pending count too
            ({}, {**BODY, "priority": 1}),
            ({"x-priority": "9"}, BODY),  # beyond the last level: clamped to P3, not an error
            ({}, {**BODY, "priority": 7}),
        ):
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
        assert r.headers["x-slo-class"] == "p3"
        assert all(n == 0 for n in slo.pending_by_priority.values()), slo.pending_by_priority
        assert slo.mapping is not None and slo.mapping.pending == (0, 0, 0, 0)
        # the one streamed completion (P2) is the only one in the windows, counted for P2
        assert slo.mapping.size == 1 and slo.mapping.counts == (0, 0, 1, 0)
        # a request refused for its model moves nothing the next P2's targets are read from
        before = slo.mapping
        unknown = {**BODY, "model": "nobody-serves-this"}
        r = httpx.post(gw.url + "/v1/chat/completions", json=unknown, headers={"x-priority": "2"})
        assert r.status_code == 404 and slo.mapping is before


def _tight_profile(tmp_path: Path) -> Path:
    path = tmp_path / "tight.yaml"
    path.write_text(
        "version: 1\nname: tight\ndefault_class: batch\n"
        "classes:\n  batch: {ttft_s: 5, tpot_s: 1, queue: {max_queued: 2, timeout_s: 0.6}}\n"
    )
    return path


def test_full_queue_sheds_with_429_and_queued_requests_time_out(engine: ChildProcess, tmp_path: Path) -> None:
    settings = {"slo_profile": str(_tight_profile(tmp_path)), "max_engine_load": 1}
    with run_gateway(engines=[engine_entry(engine)], **settings) as gw:
        long_body = {**BODY, "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            busy = pool.submit(httpx.post, gw.url + "/v1/chat/completions", json=long_body, timeout=30)
            time.sleep(0.2)  # the engine now has its one request; the next two queue
            queued = [
                pool.submit(httpx.post, gw.url + "/v1/chat/completions", json=BODY, timeout=30)
                for _ in (1, 2)
            ]
            time.sleep(0.2)
            shed = httpx.post(gw.url + "/v1/chat/completions", json=BODY)
            assert shed.status_code == 429 and shed.json()["error"]["code"] == "queue_full"
            assert int(shed.headers["retry-after"]) >= 1
            timed_out = [f.result() for f in queued]
            assert all(
                r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout" for r in timed_out
            )
            assert busy.result().status_code == 200
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'slogate_sheds_total{reason="queue_full",slo_class="batch"} 1.0' in metrics
        assert 'slogate_sheds_total{reason="timeout",slo_class="batch"} 2.0' in metrics


def test_a_full_queue_sheds_a_request_that_can_no_longer_make_its_ttft(
    engine: ChildProcess, tmp_path: Path
) -> None:
    profile = tmp_path / "doomed.yaml"
    profile.write_text(
        "version: 1\nname: doomed\ndefault_class: chat\n"
        "classes:\n  chat: {ttft_s: 0.3, tpot_s: 1, queue: {max_queued: 1, timeout_s: 20}}\n"
    )
    settings = {"slo_profile": str(profile), "max_engine_load": 1}
    with run_gateway(engines=[engine_entry(engine)], **settings) as gw:
        long_body = {**BODY, "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            busy = pool.submit(httpx.post, gw.url + "/v1/chat/completions", json=long_body, timeout=30)
            time.sleep(0.2)  # the engine has its one request
            doomed = pool.submit(httpx.post, gw.url + "/v1/chat/completions", json=BODY, timeout=30)
            time.sleep(0.4)  # queued past its 0.3 s TTFT: it can only be late now
            fresh = pool.submit(httpx.post, gw.url + "/v1/chat/completions", json=BODY, timeout=30)
            shed = doomed.result()
            # the queue was full, but the late request gives its place to one that can still make it
            assert shed.status_code == 429 and shed.json()["error"]["code"] == "slo_infeasible", shed.text
            assert fresh.result().status_code == 200
            assert busy.result().status_code == 200
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'slogate_sheds_total{reason="infeasible",slo_class="chat"} 1.0' in metrics


def test_hyperflexis_dispatcher_serves_and_reports_attainment(engine: ChildProcess) -> None:
    with run_gateway(
        engines=[engine_entry(engine, latency_profile="qwen-7b", time_scale=4.0)],
        routing_profile="hyperflexis",
    ) as gw:
        body = {**BODY, "stream": True, "max_tokens": 8, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(
                    lambda i: httpx.post(
                        gw.url + "/v1/chat/completions",
                        json=body,
                        headers={"x-slo-task": "medical_qa" if i % 2 else "wikisql"},
                        timeout=30,
                    ),
                    range(16),
                )
            )
        assert all(r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n") for r in results)
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'slogate_slo_outcomes_total{objective="both",outcome="met",slo_class="wikisql"}' in metrics


@pytest.mark.alone  # (which request a busy engine finishes first)
def test_engine_side_priority_lets_urgent_work_overtake() -> None:
    args = (
        "--profile",
        "qwen-7b",
        "--model",
        MODEL,
        "--time-scale",
        "4",
        "--max-num-seqs",
        "1",
        "--scheduling-policy",
        "priority",
    )
    with (
        spawn_sim_engine(*args, name="prio") as e,
        run_gateway(
            engines=[engine_entry(e, priority_scheduling=True)], slo_profile="hyperflexis-4task"
        ) as gw,
    ):
        # (300 tokens, ~1 s each: with 120 a loaded cold machine once saw the first end before
        # the other three reached the engine's queue)
        lax = {**BODY, "max_tokens": 300, "ignore_eos": True}
        done: dict[str, float] = {}

        def send(name: str, task: str) -> None:
            r = httpx.post(
                gw.url + "/v1/chat/completions", json=lax, headers={"x-slo-task": task}, timeout=60
            )
            assert r.status_code == 200
            done[name] = time.monotonic()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = []
            for i in range(4):  # one at a time, so their arrival order is known
                futures.append(pool.submit(send, f"lax{i}", "wikisql"))
                time.sleep(0.03)

            def queued_at_engine() -> bool:
                state = parse_vllm_metrics(httpx.get(e.url + "/metrics", timeout=5).text)
                return state.num_running == 1 and state.num_waiting == 3

            # lax0 runs, lax1-3 wait in the engine's queue (seen there: on a busy machine a fixed
            # sleep once let lax0 end, and a lax one start, before the urgent one arrived)
            assert wait_until(queued_at_engine, timeout=10, interval=0.005)
            futures.append(pool.submit(send, "urgent", "medical_qa"))
            for f in futures:
                f.result()
        # the engine ran the urgent request before the lax ones that arrived earlier
        order = sorted(done, key=done.__getitem__)
        assert order.index("urgent") < order.index("lax3"), order  # FCFS would finish it last
