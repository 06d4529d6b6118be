"""llama.cpp's ``llama-server``: ``llamacpp:*`` metrics plus ``/slots`` for KV occupancy.

Quirks handled here: ``prompt_tokens_total`` excludes cached tokens (so the prompt tokens queried
are its sum with ``prompt_tokens_cached_total``); the metrics carry no KV-cache gauge, so KV use and
capacity come from ``/slots`` (one context of ``n_ctx`` tokens per slot, token granularity); the
server ignores the request's ``model`` in single-model mode, which is harmless because the gateway
routes by model name before the request reaches it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import aiohttp

from gateway.engines import prom_text
from gateway.engines.base import EngineAdapter, control_json, gauge, load_gauges, read_control
from policies.api import EngineState, EngineTiming

#: what a scrape's /slots read leaves of the scrape's budget (the monitor's own timeout ends it)
SLOTS_MARGIN_S = 0.05
#: how long a server that refused /slots (404, 501: started without --slots) is not asked again;
#: it may be restarted with it, or the refusal may have been a proxy's during a restart
SLOTS_RETRY_S = 300.0

_TIMING = (
    "llamacpp:n_decode_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_seconds_total",
)
_WANTED = (
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:kv_cache_usage_ratio",
    *_TIMING,
)


def llamacpp_timing(samples: prom_text.Samples) -> EngineTiming | None:
    """llama-server's own counters: ``llama_decode`` calls (its steps), tokens, and the summed
    per-slot prompt and generation times."""
    if not any(name in samples for name in _TIMING):
        return None
    return EngineTiming(
        steps=prom_text.total(samples, "llamacpp:n_decode_total"),
        prompt_tokens=prom_text.total(samples, "llamacpp:prompt_tokens_total"),
        generation_tokens=prom_text.total(samples, "llamacpp:tokens_predicted_total"),
        prefill_s=prom_text.total(samples, "llamacpp:prompt_seconds_total"),
        decode_s=prom_text.total(samples, "llamacpp:tokens_predicted_seconds_total"),
    )


def parse_llamacpp_metrics(text: str) -> EngineState:
    samples = prom_text.parse(text, _WANTED)
    computed = gauge(samples, "llamacpp:prompt_tokens_total")
    cached = gauge(samples, "llamacpp:prompt_tokens_cached_total")
    running, waiting = load_gauges(samples, "llamacpp:requests_processing", "llamacpp:requests_deferred")
    return EngineState(
        num_running=running,
        num_waiting=waiting,
        kv_usage=gauge(samples, "llamacpp:kv_cache_usage_ratio"),  # older builds only
        prefix_queries=computed + cached,
        prefix_hits=cached,
        timing=llamacpp_timing(samples),
    )


def with_slots(state: EngineState, slots: Sequence[Mapping[str, Any]]) -> EngineState:
    """``state`` with KV use and capacity read off ``/slots`` (tokens held by busy slots / all contexts)."""
    capacity = sum(int(slot.get("n_ctx") or 0) for slot in slots)
    if capacity <= 0:
        return state
    used = 0
    for slot in slots:
        if slot.get("is_processing"):
            tokens = slot.get("next_token") or ()
            # a one-element list in current builds, the object itself in older ones
            decoded = sum(
                int(t.get("n_decoded") or 0) for t in ([tokens] if isinstance(tokens, Mapping) else tokens)
            )
            used += int(slot.get("n_prompt_tokens") or 0) + decoded
    return replace(state, kv_usage=min(1.0, max(0, used) / capacity), block_size=1, num_gpu_blocks=capacity)


class LlamaCppAdapter(EngineAdapter):
    kind: ClassVar[str] = "llamacpp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a server started without --slots answers 501: not asked again for SLOTS_RETRY_S
        self._slots_refused_at: float | None = None

    def parse_metrics(self, text: str) -> EngineState | None:
        return parse_llamacpp_metrics(text)

    async def scrape(self) -> EngineState | None:
        started = time.monotonic()
        state = await super().scrape()
        if state is None:
            return state
        refused = self._slots_refused_at
        if refused is not None and started - refused < SLOTS_RETRY_S:
            return state
        # /slots gets what is left of the scrape's budget (less a margin): the monitor times
        # the whole scrape, and a slow /slots must not cost the metrics already read
        total = self._scrape_timeout.total or 0.0
        left = started + total - time.monotonic() - SLOTS_MARGIN_S
        if left <= 0.0:
            return state
        try:
            async with self.session.get(
                self.url("/slots"),
                timeout=aiohttp.ClientTimeout(total=left),
                headers=self._auth,
                allow_redirects=False,
            ) as resp:
                if resp.status in (404, 501):
                    self._slots_refused_at = time.monotonic()
                    return state
                self._slots_refused_at = None
                resp.raise_for_status()
                slots = control_json(await read_control(resp))
            # (the engine's answer is untrusted: any shape but the expected one is no reading)
            return with_slots(state, slots) if isinstance(slots, list) else state
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError, OverflowError):
            return state  # the metrics alone are still a valid reading
