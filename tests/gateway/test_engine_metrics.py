"""Engine /metrics text -> EngineState, for every adapter kind, on literal scrapes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.engines import prom_text
from gateway.engines.base import EngineAdapter
from gateway.engines.llamacpp import parse_llamacpp_metrics, with_slots
from gateway.engines.sglang import parse_sglang_metrics
from gateway.engines.vllm import parse_vllm_metrics
from policies.api import EngineTiming

VLLM_033 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 960.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""

VLLM_OLD = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5
"""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def _llamacpp(metrics: Handler, slots: Handler) -> AsyncIterator[EngineAdapter]:
    """A llama.cpp adapter in front of a server answering /metrics and /slots with these."""
    from aiohttp.test_utils import TestServer

    from gateway.engines import adapter_for
    from gateway.settings import EngineConfig

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/slots", slots)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        config = EngineConfig(url=str(server.make_url("/")), kind="llamacpp", model="m", name="l0")
        async with aiohttp.ClientSession() as session:
            yield adapter_for(config, session, 1.0, scrape_timeout_s=0.5)
    finally:
        await server.close()


def test_vllm_033_sums_dp_ranks_and_reads_cache_config() -> None:
    state = parse_vllm_metrics(VLLM_033)
    assert (state.num_running, state.num_waiting) == (5, 4)
    assert state.kv_usage == 0.5  # the fullest rank bounds what fits
    assert (state.prefix_queries, state.prefix_hits) == (1000.0, 960.0)
    assert (state.block_size, state.num_gpu_blocks) == (16, 2048)
    assert state.sleeping is False


def test_vllm_old_names() -> None:
    state = parse_vllm_metrics(VLLM_OLD)
    assert (state.num_running, state.kv_usage, state.prefix_queries, state.prefix_hits) == (
        1,
        0.75,
        10.0,
        5.0,
    )


def test_vllm_sleeping() -> None:
    text = 'vllm:engine_sleep_state{sleep_state="awake"} 0\nvllm:engine_sleep_state{sleep_state="discard_all"} 1\n'
    assert parse_vllm_metrics("vllm:num_requests_running 0\n" + text).sleeping is True


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_vllm_metrics, 'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'),
        (parse_sglang_metrics, 'sglang:token_usage{model_name="m"} 0.4\n'),
        (parse_llamacpp_metrics, "llamacpp:prompt_tokens_total 120\n"),
        (parse_vllm_metrics, "<html>a proxy's page</html>\n"),
    ],
)
def test_metrics_without_either_load_gauge_are_no_reading(parse: Any, text: str) -> None:
    """An engine with its stats off, a proxy's page, a renamed metric: read as zeros, it looked
    idle and fresh (its load hidden, and the stall check never judging it)."""
    with pytest.raises(ValueError, match="neither"):
        parse(text)


def test_sglang() -> None:
    text = """\
sglang:num_running_reqs{model_name="m"} 7
sglang:num_queue_reqs{model_name="m"} 2
sglang:token_usage{model_name="m"} 0.4
sglang:prompt_tokens_total{model_name="m"} 500
sglang:cached_tokens_total{model_name="m"} 100
sglang:max_total_num_tokens{model_name="m"} 65536
"""
    state = parse_sglang_metrics(text)
    assert (state.num_running, state.num_waiting, state.kv_usage) == (7, 2, 0.4)
    assert (state.prefix_queries, state.prefix_hits, state.num_gpu_blocks) == (500.0, 100.0, 65536)


def test_llamacpp() -> None:
    text = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
llamacpp:prompt_tokens_total 120
llamacpp:prompt_tokens_cached_total 40
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
"""
    state = parse_llamacpp_metrics(text)
    # the engine counts computed and cached prompt tokens apart: 160 were queried, 40 hit
    assert (state.num_running, state.num_waiting, state.prefix_queries, state.prefix_hits) == (
        2,
        1,
        160.0,
        40.0,
    )


def test_llamacpp_slots_give_kv_use_and_capacity() -> None:
    slots = [  # the fields llama-server's /slots returns that matter here (others elided)
        {
            "id": 0,
            "n_ctx": 2048,
            "is_processing": True,
            "n_prompt_tokens": 300,
            "next_token": [{"n_decoded": 100}],
        },
        {
            "id": 1,
            "n_ctx": 2048,
            "is_processing": False,
            "n_prompt_tokens": 900,
            "next_token": [{"n_decoded": 5}],
        },
    ]
    state = with_slots(parse_llamacpp_metrics("llamacpp:requests_processing 1\n"), slots)
    assert state.num_gpu_blocks == 4096 and state.block_size == 1
    assert state.kv_usage == pytest.approx(400 / 4096)  # an idle slot's leftover context is cache, not use
    assert with_slots(state, []) == state


def test_parser_tolerates_junk_escapes_and_nan() -> None:
    text = 'a{x="q\\"uote",y="2"} 1\nbroken line\na{x="z"} NaN\nb 3 1700000000\n'
    samples = prom_text.parse(text, ["a", "b"])
    assert samples["a"] == [({"x": 'q"uote', "y": "2"}, 1.0)]
    assert prom_text.total(samples, "missing", "b") == 3.0


def test_parser_reads_escapes_and_exemplars_and_bounds_what_it_reads() -> None:
    """A label value was read a character at a time on the event loop (a 16 MB one from a broken
    or hostile engine, every scrape); an exemplar's value was taken for the sample's."""
    text = (
        'a{x="back\\\\slash\\nnewline}",y="2",} 5 # {trace_id="abc"} 99 123\n'
        + 'a{x="'
        + "v" * prom_text.MAX_LINE_CHARS
        + '"} 6\n'  # too long: skipped
        + "a{"
        + ",".join(f'l{i}="1"' for i in range(prom_text.MAX_LABELS + 1))
        + "} 7\n"  # too many labels
        + 'a{x="unterminated} 8\n'
    )
    samples = prom_text.parse(text, ["a"])
    assert samples["a"] == [({"x": "back\\slash\nnewline}", "y": "2"}, 5.0)]
    many = "".join(f'b{{rank="{i}"}} 1\n' for i in range(prom_text.MAX_SAMPLES + 10))
    assert len(prom_text.parse(many, ["b"])["b"]) == prom_text.MAX_SAMPLES


def test_a_kv_use_is_the_fullest_rank_s_and_none_reported_is_unknown() -> None:
    text = """\
sglang:num_running_reqs{model_name="m",dp="0"} 1
sglang:token_usage{model_name="m",dp="0"} 0.6
sglang:token_usage{model_name="m",dp="1"} 0.5
sglang:max_total_num_tokens{model_name="m",dp="0"} 1000
sglang:max_total_num_tokens{model_name="m",dp="1"} 1000
"""
    state = parse_sglang_metrics(text)
    assert (state.kv_usage, state.num_gpu_blocks) == (0.6, 2000)
    # without a KV gauge (a renamed metric, stats off): the capacity is not all free, it is unknown
    no_use = parse_sglang_metrics("sglang:num_running_reqs 50\nsglang:max_total_num_tokens 1000\n")
    assert no_use.num_gpu_blocks is None
    vllm = parse_vllm_metrics(
        'vllm:num_requests_running 50\nvllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1\n'
    )
    assert vllm.num_gpu_blocks is None and vllm.block_size == 16


# -- the engines' own timing (latency learning) -------------------------------------------------------

#: vLLM 0.33's timing series as it exposes them (two data-parallel ranks; buckets elided where
#: they add nothing: the parser reads the _sum and _count series)
VLLM_033_TIMING = """\
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 120.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 120.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 5230.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 80.0
vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 770.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 4100.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 300.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1130.0
vllm:generation_tokens_total{engine="1",model_name="m"} 470.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 9.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:request_prefill_time_seconds_count{engine="1",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.5
vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 12.0
vllm:request_inference_time_seconds_sum{engine="0",model_name="m"} 13.5
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 4100.0
"""


def test_vllm_timing_sums_ranks_and_reads_sums_and_counts() -> None:
    timing = parse_vllm_metrics(VLLM_033 + VLLM_033_TIMING).timing
    assert timing == EngineTiming(
        steps=200.0,
        step_tokens=6000.0,
        prompt_tokens=4400.0,
        generation_tokens=1600.0,
        preemptions=2.0,
        finished=14.0,
        queue_s=0.25,
        prefill_s=2.0,
        decode_s=12.0,
    )
    # an engine that exports none of them: no timing, rather than zeros that would read as idle
    assert parse_vllm_metrics(VLLM_033).timing is None
    assert parse_vllm_metrics(VLLM_OLD).timing is None


#: a real llama-server's /metrics (llama.cpp from llama-cpp-python 0.3.36's vendored tree, tiny
#: model, two requests), verbatim
LLAMACPP_REAL = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 27
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 0
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.00222
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 6
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 0.002264
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 6
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 23
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 12162.2
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 1766.78
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1
"""


def test_llamacpp_timing_from_a_real_scrape() -> None:
    state = parse_llamacpp_metrics(LLAMACPP_REAL)
    assert state.timing == EngineTiming(
        steps=6.0, prompt_tokens=27.0, generation_tokens=6.0, prefill_s=0.00222, decode_s=0.002264
    )
    assert (state.prefix_queries, state.prefix_hits, state.num_running) == (27.0, 0.0, 0)


def test_sglang_timing() -> None:
    text = """\
sglang:num_running_reqs{model_name="m"} 7
sglang:prompt_tokens_total{model_name="m"} 500
sglang:generation_tokens_total{model_name="m"} 900
sglang:queue_time_seconds_bucket{le="0.1",model_name="m"} 3
sglang:queue_time_seconds_sum{model_name="m"} 0.75
sglang:queue_time_seconds_count{model_name="m"} 5
"""
    assert parse_sglang_metrics(text).timing == EngineTiming(
        prompt_tokens=500.0, generation_tokens=900.0, finished=5.0, queue_s=0.75
    )


HOSTILE = """\
vllm:num_requests_running{engine="0",model_name="m"} 1e308
vllm:num_requests_waiting{engine="0",model_name="m"} 1e308
vllm:kv_cache_usage_perc{engine="0",model_name="m"} +Inf
vllm:prefix_cache_queries_total{engine="0",model_name="m"} -5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="99999999999999999999"} 1.0
"""


def test_no_number_an_engine_reports_breaks_routing_for_any_model() -> None:
    """A broken or hostile engine's metrics: infinities are no reading, and counts past what a
    float holds used to make every snapshot of every model raise (the snapshot's load is a
    float of the reported counts), and an infinite KV share made the free-KV check raise."""
    from gateway.dispatch.offline import offline_fleet
    from gateway.fleet.registry import MAX_REPORTED, bounded_state

    assert prom_text.parse("x +Inf\ny -Inf\nz 2\n", ["x", "y", "z"]) == {"z": [({}, 2.0)]}
    state = parse_vllm_metrics(HOSTILE)
    fleet = offline_fleet({"a": 1, "b": 1})
    fleet.record_state("a-0", state, 0.0)
    recorded = fleet.records["a-0"].state
    assert recorded is not None
    assert recorded.num_running == recorded.num_waiting == MAX_REPORTED
    assert recorded.kv_usage == 0.0 and recorded.prefix_queries == 0.0 and recorded.num_gpu_blocks is None
    assert [e.engine_id for e in fleet.candidates("b", 0.0)] == ["b-0"]
    assert [e.engine_id for e in fleet.candidates("a", 0.0)] == ["a-0"]
    assert fleet.snapshot(0.0).engines[0].load > 0
    assert fleet.records["a-0"].free_kv_tokens() is None
    # a sane reading is kept as it is, the same object
    sane = parse_vllm_metrics(VLLM_033)
    assert bounded_state(sane) is sane
    # a share past 1 (or below 0) is brought within bounds
    over = parse_vllm_metrics('vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc{engine="0"} 7\n')
    assert bounded_state(over).kv_usage == 1.0


def test_llamacpp_slots_of_older_builds_and_junk_slots() -> None:
    """Older llama-server builds send ``next_token`` as the object itself, not a one-element
    list: iterating it gave its keys, and the scrape failed whenever a slot was busy."""
    busy = {
        "id": 0,
        "n_ctx": 1000,
        "is_processing": True,
        "n_prompt_tokens": 30,
        "next_token": {"n_decoded": 10},
    }
    state = with_slots(parse_llamacpp_metrics("llamacpp:requests_processing 1\n"), [busy])
    assert state.kv_usage == pytest.approx(40 / 1000)


async def test_a_llamacpp_scrape_keeps_its_metrics_when_slots_are_junk_or_slow() -> None:
    slots: dict[str, object] = {"body": [{"n_ctx": "x", "is_processing": True}], "delay": 0.0}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="llamacpp:requests_processing 2\n")

    async def slots_route(_: web.Request) -> web.Response:
        await asyncio.sleep(float(slots["delay"]))  # type: ignore[arg-type]
        return web.json_response(slots["body"])

    async with _llamacpp(metrics, slots_route) as adapter:
        state = await adapter.scrape()  # junk slots: the metrics reading stands
        assert state is not None and state.num_running == 2
        slots["body"] = [{"n_ctx": 1000, "is_processing": True, "n_prompt_tokens": float("inf")}]
        state = await adapter.scrape()  # (Infinity is no JSON: junk, as above)
        assert state is not None and state.num_running == 2
        slots["body"], slots["delay"] = [], 5.0
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(3.0):  # (the monitor's own limit is the scrape timeout)
            state = await adapter.scrape()
        assert state is not None and state.num_running == 2
        assert asyncio.get_running_loop().time() - started < 1.5  # not the 5 s /slots takes


async def test_a_llamacpp_server_that_refused_slots_is_asked_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One 404/501 from /slots (a server started without --slots, or a proxy's answer while it
    restarted) turned slot reading off for the gateway's lifetime: a server restarted with
    --slots was never read again. It is asked again after SLOTS_RETRY_S."""
    import gateway.engines.llamacpp as llamacpp

    monkeypatch.setattr(llamacpp, "SLOTS_RETRY_S", 0.2, raising=False)
    hits: list[int] = []
    refuse = [True]
    busy = {
        "id": 0,
        "n_ctx": 1000,
        "is_processing": True,
        "n_prompt_tokens": 300,
        "next_token": [{"n_decoded": 100}],
    }

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="llamacpp:requests_processing 1\n")

    async def slots_route(_: web.Request) -> web.Response:
        hits.append(1)
        return web.Response(status=501, text="no slots") if refuse[0] else web.json_response([busy])

    async with _llamacpp(metrics, slots_route) as adapter:
        state = await adapter.scrape()
        assert state is not None and state.num_gpu_blocks is None and len(hits) == 1
        refuse[0] = False  # restarted with --slots
        await adapter.scrape()
        assert len(hits) == 1  # not asked again at once
        await asyncio.sleep(0.25)
        state = await adapter.scrape()
        assert len(hits) == 2 and state is not None and state.num_gpu_blocks == 1000


def test_requests_placed_while_a_scrape_was_in_flight_count_on_top_of_its_report() -> None:
    """The in-flight count subtracted from a report was taken when its answer arrived: requests
    placed while the scrape was in flight, which the report never held, hid as much of the
    engine's other load until the next scrape."""
    from gateway.dispatch.offline import offline_fleet
    from gateway.fleet.registry import RunningEntry
    from policies.api import EngineState, estimated_load

    fleet = offline_fleet({"m": 1})
    engine_id = "m-0"
    for i in range(20):
        fleet.reserve(engine_id, f"a{i}", RunningEntry(100, 100, 0.1, 0.0))
    record = fleet.records[engine_id]
    at_send = (record.in_flight, record.in_flight_tokens)
    for i in range(10):  # placed while /metrics was being answered
        fleet.reserve(engine_id, f"b{i}", RunningEntry(100, 100, 0.1, 0.0))
    report = EngineState(num_running=20, kv_usage=4000 / 16000, block_size=16, num_gpu_blocks=1000)
    fleet.record_state(engine_id, report, 1.0, 0.5, at_send)
    snapshot = next(e for e in fleet.candidates("m", 1.0) if e.engine_id == engine_id)
    assert estimated_load(snapshot) == 30
    assert record.free_kv_tokens() == 16000 - 6000
