"""vLLM (0.33 names, with fallbacks for older releases) and the simulated engine, which speaks vLLM."""

from __future__ import annotations

from typing import ClassVar

from gateway.engines import prom_text
from gateway.engines.base import EngineAdapter, gauge, load_gauges, read_control
from policies.api import EngineState, EngineTiming, Role

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_NEW, _KV_OLD = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
_QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries",
)
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits")
_CACHE_INFO = "vllm:cache_config_info"
_SLEEP = "vllm:engine_sleep_state"
_ITERATION = "vllm:iteration_tokens_total"
_QUEUE = "vllm:request_queue_time_seconds"
_PREFILL = "vllm:request_prefill_time_seconds"
_DECODE = "vllm:request_decode_time_seconds"
_PROMPT_TOKENS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens")
_GENERATION_TOKENS = ("vllm:generation_tokens_total", "vllm:generation_tokens")
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
_TIMING = (
    f"{_ITERATION}_count",
    f"{_ITERATION}_sum",
    f"{_QUEUE}_sum",
    f"{_PREFILL}_count",
    f"{_PREFILL}_sum",
    f"{_DECODE}_sum",
    *_PROMPT_TOKENS,
    *_GENERATION_TOKENS,
    *_PREEMPTIONS,
)
_WANTED = (_RUNNING, _WAITING, _KV_NEW, _KV_OLD, *_QUERIES, *_HITS, _CACHE_INFO, _SLEEP, *_TIMING)


def vllm_timing(samples: prom_text.Samples) -> EngineTiming | None:
    """vLLM's own work and timing counters (summed over data-parallel ranks); ``None`` when the
    engine exports none of them (an old release)."""
    if not any(name in samples for name in _TIMING):
        return None
    return EngineTiming(
        steps=prom_text.total(samples, f"{_ITERATION}_count"),
        step_tokens=prom_text.total(samples, f"{_ITERATION}_sum"),
        prompt_tokens=prom_text.total(samples, *_PROMPT_TOKENS),
        generation_tokens=prom_text.total(samples, *_GENERATION_TOKENS),
        preemptions=prom_text.total(samples, *_PREEMPTIONS),
        finished=prom_text.total(samples, f"{_PREFILL}_count"),
        queue_s=prom_text.total(samples, f"{_QUEUE}_sum"),
        prefill_s=prom_text.total(samples, f"{_PREFILL}_sum"),
        decode_s=prom_text.total(samples, f"{_DECODE}_sum"),
    )


def _label_count(value: str | None, otherwise: int | None) -> int | None:
    """A count an info series gives as a label; ``otherwise`` when it is not one (a label of odd
    digits, "¹⁶" or thousands of them, failed the whole scrape: the engine's load went stale)."""
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 18:
        return otherwise
    return int(value)


def parse_vllm_metrics(text: str) -> EngineState:
    """Map vLLM's ``/metrics`` onto EngineState, summing over data-parallel ``engine`` labels."""
    samples = prom_text.parse(text, _WANTED)
    kv_samples = samples.get(_KV_NEW) or samples.get(_KV_OLD) or []
    kv_usage = max((v for _, v in kv_samples), default=0.0)
    block_size: int | None = None
    # (with data parallelism vLLM's front end sums every rank's blocks into the one cache config
    # each rank's line reports: any line is the engine's whole capacity)
    num_blocks: int | None = None
    for labels, _ in samples.get(_CACHE_INFO, []):
        block_size = _label_count(labels.get("block_size"), block_size)
        num_blocks = _label_count(labels.get("num_gpu_blocks"), num_blocks)
    if not kv_samples:
        num_blocks = None  # (no use reported: its free KV is unknown, not all of it)
    sleeping = any(
        labels.get("sleep_state") not in (None, "awake") and value > 0
        for labels, value in samples.get(_SLEEP, [])
    )
    running, waiting = load_gauges(samples, _RUNNING, _WAITING)
    return EngineState(
        num_running=running,
        num_waiting=waiting,
        kv_usage=kv_usage,
        prefix_queries=gauge(samples, *_QUERIES),
        prefix_hits=gauge(samples, *_HITS),
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        sleeping=sleeping,
        timing=vllm_timing(samples),
    )


class VllmAdapter(EngineAdapter):
    switches_role: ClassVar[bool] = True
    kind: ClassVar[str] = "vllm"
    supports_priority_field: ClassVar[bool] = True
    lists_served_model: ClassVar[bool] = True  # (a name it does not list: 404 "does not exist")

    def parse_metrics(self, text: str) -> EngineState | None:
        return parse_vllm_metrics(text)

    def can_switch_role(self) -> str | None:
        # A vLLM engine changes side per request (its kv_transfer_params) when it runs a KV
        # connector as kv_both: one configured in a P/D role, or with kv_transfer declared, is
        # taken to. A plain collocated one was flipped with a 200 and nothing told: every prefill
        # it then served came back without kv_transfer_params, a 502 each.
        if self.config.role is Role.COLLOCATED and self.config.kv_transfer is None:
            return (
                "nothing says it runs a KV connector (vLLM --kv-transfer-config, kv_role kv_both), "
                "which a prefill or decode engine needs: declare kv_transfer in its configuration "
                "once it does"
            )
        return None


class SimAdapter(VllmAdapter):
    """The simulated engine: vLLM's wire protocol; it takes the client's x-sim-* controls."""

    kind: ClassVar[str] = "sim"
    accepts_sim_headers: ClassVar[bool] = True

    def can_switch_role(self) -> str | None:
        return None  # (it serves any role: told by switch_role)

    async def switch_role(self, role: Role) -> None:
        """The simulated engine's bootstrap (SGLang-style) handling depends on its role."""
        async with self.session.post(
            self.url("/sim/role"),
            json={"role": role.value},
            timeout=self._health_timeout,
            headers=self._auth,
            allow_redirects=False,
        ) as resp:
            await read_control(resp)
            resp.raise_for_status()
