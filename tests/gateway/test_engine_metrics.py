"""Engine /metrics text -> EngineState, for every adapter kind, on literal scrapes."""

from __future__ import annotations

import pytest

from gateway.engines import prom_text
from gateway.engines.llamacpp import parse_llamacpp_metrics, with_slots
from gateway.engines.sglang import parse_sglang_metrics
from gateway.engines.vllm import parse_vllm_metrics

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
    assert parse_vllm_metrics(text).sleeping is True


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
