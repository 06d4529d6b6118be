"""llama.cpp's ``llama-server``: ``llamacpp:*`` metrics; it ignores the request's ``model``."""

from __future__ import annotations

from typing import ClassVar

from gateway.engines import prom_text
from gateway.engines.base import EngineAdapter, gauge
from policies.api import EngineState

_WANTED = (
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:kv_cache_usage_ratio",
)


def parse_llamacpp_metrics(text: str) -> EngineState:
    samples = prom_text.parse(text, _WANTED)
    return EngineState(
        num_running=int(gauge(samples, "llamacpp:requests_processing")),
        num_waiting=int(gauge(samples, "llamacpp:requests_deferred")),
        kv_usage=gauge(samples, "llamacpp:kv_cache_usage_ratio"),
        prefix_queries=gauge(samples, "llamacpp:prompt_tokens_total"),
        prefix_hits=gauge(samples, "llamacpp:prompt_tokens_cached_total"),
    )


class LlamaCppAdapter(EngineAdapter):
    kind: ClassVar[str] = "llamacpp"

    def parse_metrics(self, text: str) -> EngineState | None:
        return parse_llamacpp_metrics(text)
