"""The simulated engine's own timing statistics, kept as vLLM 0.33 keeps them.

vLLM records one ``IterationStats`` per engine step that produced output (the tokens it carried:
prompt tokens of requests whose first token came in that step plus the tokens generated) and, for
every finished request, its queue, prefill, decode and inference times (``queued -> scheduled ->
first token -> last token``, preemptions included). The engine model records the same here at the
same moments, in plain accumulators with vLLM's buckets, so the exported histograms and the state
the offline simulator scrapes (:func:`gateway.sim.metrics.engine_state`) are one set of numbers.
Times are the model's simulated seconds divided by ``time_scale`` (a scaled engine reports real
seconds, as its other latency histograms do).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

#: vLLM's request latency buckets (e2e, queue, prefill, decode, inference), seconds
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
#: vLLM's time-per-output-token (and inter-token latency) buckets, seconds
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
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
)
#: ``vllm:iteration_tokens_total`` buckets (tokens per engine step)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket (``le`` upper bounds, then +Inf), with their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations <= le)`` pairs ending with ``+Inf``, as Prometheus exposes them."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
        out.append(("+Inf", self.count))
        return out


class EngineStats:
    """The per-step and per-request histograms vLLM exports and the simulated engine now does."""

    def __init__(self, max_model_len: int, time_scale: float = 1.0) -> None:
        #: simulated seconds per reported second
        self.time_scale = time_scale
        tokens = buckets_1_2_5(max_model_len)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(TPOT_BUCKETS)
        self.prompt_tokens = Histogram(tokens)
        self.generation_tokens = Histogram(tokens)
        self.max_tokens = Histogram(tokens)
        self.prefill_kv_computed = Histogram(tokens)

    def step(self, first_token_prompts: int, generated: int) -> None:
        """One engine step that produced output: prompt tokens of the requests whose first token
        it made, plus every token it generated (vLLM's ``iteration_tokens_total``)."""
        self.iteration_tokens.observe(first_token_prompts + generated)

    def finished(
        self,
        *,
        arrival: float,
        scheduled: float,
        first_token: float,
        last_token: float,
        prompt_tokens: int,
        cached_tokens: int,
        generated: int,
        max_tokens: int,
    ) -> None:
        """A request that produced output finished (times in simulated seconds)."""
        scale = self.time_scale
        decode = (last_token - first_token) / scale
        self.queue.observe((scheduled - arrival) / scale)
        self.prefill.observe((first_token - scheduled) / scale)
        self.decode.observe(decode)
        self.inference.observe((last_token - scheduled) / scale)
        self.time_per_output_token.observe(decode / (generated - 1) if generated > 1 else 0.0)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)
        self.max_tokens.observe(max_tokens)
        self.prefill_kv_computed.observe(prompt_tokens - max(cached_tokens, 0))
