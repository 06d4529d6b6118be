"""Prometheus metrics of one simulated engine, with vLLM 0.33's names, labels and buckets.

Gauges, counters and the engine's own statistics (vLLM's per-step ``iteration_tokens_total`` and
per-finished-request queue, prefill, decode and inference times and token counts, kept by the
model in :mod:`gateway.sim.stats`) are read from the engine model at scrape time (a custom
collector), so the per-token hot path pays nothing for them; only the latencies the HTTP layer
sees are observed as they happen (TTFT and e2e per request, inter-token latency per streamed
token). Each engine has its own :class:`CollectorRegistry`, so several engines can live in one
process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from gateway.sim.stats import REQUEST_LATENCY_BUCKETS, TPOT_BUCKETS
from gateway.sim.stats import Histogram as StatHistogram
from policies.api import EngineState, EngineTiming

if TYPE_CHECKING:
    from gateway.sim.engine import EngineModel
    from gateway.sim.server import SimServer


def engine_state(model: EngineModel, sleeping: bool = False) -> EngineState:
    """What the gateway's vLLM adapter reads off this engine's ``/metrics``, without the text:
    the offline cluster simulator scrapes with it, and the exported gauges come from it, so the
    two cannot disagree (a test parses the text and compares)."""
    stats = model.stats
    counters = model.counters
    timing = EngineTiming(
        steps=float(stats.iteration_tokens.count),
        step_tokens=float(stats.iteration_tokens.total),
        prompt_tokens=float(counters.prompt_tokens),
        generation_tokens=float(counters.generation_tokens),
        preemptions=float(counters.preemptions),
        finished=float(stats.prefill.count),
        queue_s=stats.queue.total,
        prefill_s=stats.prefill.total,
        decode_s=stats.decode.total,
    )
    return EngineState(
        num_running=len(model.running),
        num_waiting=len(model.waiting) + len(model.transferring),
        kv_usage=model.cache.usage,
        prefix_queries=float(model.counters.prefix_queries),
        prefix_hits=float(model.counters.prefix_hits),
        block_size=model.profile.block_size,
        num_gpu_blocks=model.profile.num_gpu_blocks,
        sleeping=sleeping,
        timing=timing,
    )


TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = TPOT_BUCKETS
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS

#: vLLM's histograms the engine model keeps itself: (name, help, the model's accumulator)
_MODEL_HISTOGRAMS = (
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue"),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", "prefill"),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "decode"),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "inference",
    ),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "time_per_output_token",
    ),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "max_tokens"),
    (
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        "prefill_kv_computed",
    ),
)


class _Collector:
    """Gauges and counters read from the model at scrape time: no per-token cost."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = self.server
        m = s.model
        labels = ["model_name", "engine"]
        values = [s.config.model, s.config.engine_id]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        state = engine_state(m)
        yield gauge("vllm:num_requests_running", "Requests in the running batch", state.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting", state.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = 100%", state.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries (tokens)", state.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits (tokens)", state.prefix_hits)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed", m.counters.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generation tokens processed", m.counters.generation_tokens)
        yield counter("vllm:num_preemptions", "Preemptions", m.counters.preemptions)
        success = CounterMetricFamily(
            "vllm:request_success", "Finished requests", labels=[*labels, "finished_reason"]
        )
        for reason, n in sorted(m.counters.finished.items()):
            success.add_metric([*values, reason], n)
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Cache configuration",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "engine", "num_gpu_blocks"],
        )
        info.add_metric(
            [str(state.block_size), "auto", "True", s.config.engine_id, str(state.num_gpu_blocks)],
            1.0,
        )
        yield info
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Sleep state", labels=[*labels, "sleep_state"])
        for mode in ("awake", "weights_offloaded", "discard_all"):
            sleep.add_metric([*values, mode], 1.0 if s.admin.sleep_state == mode else 0.0)
        yield sleep
        for name, doc, attribute in _MODEL_HISTOGRAMS:
            histogram: StatHistogram = getattr(m.stats, attribute)
            family = HistogramMetricFamily(name, doc, labels=labels)
            family.add_metric(values, histogram.cumulative(), sum_value=histogram.total)
            yield family


class SimMetrics:
    """The registry and the latency histograms the HTTP layer observes (TTFT, inter-token, e2e),
    labelled with ``model_name`` and ``engine``; the rest come from the model (the collector)."""

    def __init__(self, server: SimServer) -> None:
        config = server.config
        labels = ["model_name", "engine"]
        values = (config.model, config.engine_id)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(server))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (s)",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*values)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency (s)",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency (s)",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(*values)
