"""SGLang: its ``sglang:*`` metrics and its priority direction (higher values first by default)."""

from __future__ import annotations

from typing import ClassVar

from gateway.engines import prom_text
from gateway.engines.base import EngineAdapter, gauge, load_gauges
from policies.api import EngineState, EngineTiming

_TIMING = (
    "sglang:generation_tokens_total",
    "sglang:queue_time_seconds_sum",
    "sglang:queue_time_seconds_count",
)
_WANTED = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:max_total_num_tokens",
    *_TIMING,
)


def sglang_timing(samples: prom_text.Samples) -> EngineTiming | None:
    """What SGLang tells of its own work: tokens processed and the time requests queued (it has
    no per-step or prefill/decode time series)."""
    if not any(name in samples for name in _TIMING):
        return None
    return EngineTiming(
        prompt_tokens=prom_text.total(samples, "sglang:prompt_tokens_total"),
        generation_tokens=prom_text.total(samples, "sglang:generation_tokens_total"),
        finished=prom_text.total(samples, "sglang:queue_time_seconds_count"),
        queue_s=prom_text.total(samples, "sglang:queue_time_seconds_sum"),
    )


def parse_sglang_metrics(text: str) -> EngineState:
    samples = prom_text.parse(text, _WANTED)
    max_tokens = prom_text.total(samples, "sglang:max_total_num_tokens")
    running, waiting = load_gauges(samples, "sglang:num_running_reqs", "sglang:num_queue_reqs")
    # a share per series (one per data-parallel rank): the fullest one, as vLLM's is read (their
    # sum read two ranks 60 % full as a full engine)
    usage = [v for _, v in samples.get("sglang:token_usage", ())]
    if not usage:
        max_tokens = None  # (no use reported: its free KV is unknown, not all of it)
    return EngineState(
        num_running=running,
        num_waiting=waiting,
        kv_usage=max(usage, default=0.0),
        prefix_queries=gauge(samples, "sglang:prompt_tokens_total"),
        prefix_hits=gauge(samples, "sglang:cached_tokens_total"),
        block_size=1,  # SGLang's radix cache works at token granularity
        num_gpu_blocks=int(max_tokens) if max_tokens else None,
        timing=sglang_timing(samples),
    )


class SglangAdapter(EngineAdapter):
    kind: ClassVar[str] = "sglang"
    supports_priority_field: ClassVar[bool] = True
    # SGLang's scheduler runs higher values first unless --schedule-low-priority-values-first
    priority_low_first_default: ClassVar[bool] = False
    # (its KV events carry block_size = --page-size; the scrape says 1, token granularity)
    scraped_block_size_keys_events: ClassVar[bool] = False

    def parse_metrics(self, text: str) -> EngineState | None:
        return parse_sglang_metrics(text)
