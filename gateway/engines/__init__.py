"""Engine adapters, one per engine kind; :func:`adapter_for` picks the class for a config."""

from __future__ import annotations

import aiohttp

from gateway.engines.base import EngineAdapter
from gateway.engines.llamacpp import LlamaCppAdapter
from gateway.engines.sglang import SglangAdapter
from gateway.engines.vllm import SimAdapter, VllmAdapter
from gateway.settings import EngineConfig


class OpenAIAdapter(EngineAdapter):
    """Any OpenAI-compatible server: no metrics, no hooks; health is ``GET /v1/models``."""

    metrics_path = None
    health_path = "/v1/models"


ADAPTERS: dict[str, type[EngineAdapter]] = {
    "vllm": VllmAdapter,
    "sim": SimAdapter,
    "sglang": SglangAdapter,
    "llamacpp": LlamaCppAdapter,
    "openai": OpenAIAdapter,
}


def adapter_for(
    config: EngineConfig,
    session: aiohttp.ClientSession,
    health_timeout_s: float,
    *,
    scrape_timeout_s: float | None = None,
    forward_sim_headers: bool = False,
) -> EngineAdapter:
    return ADAPTERS[config.kind](
        config,
        session,
        health_timeout_s,
        scrape_timeout_s=scrape_timeout_s,
        forward_sim_headers=forward_sim_headers,
    )


__all__ = ["ADAPTERS", "EngineAdapter", "OpenAIAdapter", "adapter_for"]
