"""Classification, priority-to-SLO mapping, latency models and SLO accounting for the gateway.

The decisions are pure policies (``policies.slo``, ``policies.priority_mapping``,
``policies.latency_fit``); this module holds their explicit state between requests, reads the
hints from request headers, and turns completions into metrics, mapping-window entries and
latency-model samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gateway import metrics
from gateway.settings import Settings
from gateway.sim.profiles import load_profile
from policies.latency_fit import Coeffs, DecodeSample, LatencyModel, PrefillSample
from policies.priority_mapping import PriorityMappingState, observe_completion, set_pending
from policies.slo import (
    SloHints,
    SloProfile,
    SloTarget,
    classify,
    classify_mapped,
    initial_priority_state,
    parse_slo_profile,
)

#: prior used for engines without a latency profile (a 7B-class engine, seconds)
DEFAULT_PREFILL: Coeffs = (0.025, 1e-4, 0.0)
DEFAULT_DECODE: Coeffs = (0.012, 4e-8, 1e-4)
REFIT_EVERY = 64


def _float(value: bytes | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


class SloService:
    def __init__(self, settings: Settings) -> None:
        path = settings.slo_profile_path()
        self.profile: SloProfile = parse_slo_profile(path.read_text(), str(path))
        self.mapping: PriorityMappingState | None = initial_priority_state(self.profile)
        self.key_tasks = {f"Bearer {k}".encode(): v for k, v in settings.api_key_tasks.items()}
        self.key_tenants = {f"Bearer {k}".encode(): v for k, v in settings.api_key_tenants.items()}
        self.models: dict[str, LatencyModel] = {}
        self._observations: dict[str, int] = {}
        for engine in settings.engines:
            prefill, decode = DEFAULT_PREFILL, DEFAULT_DECODE
            if engine.latency_profile:
                latency = load_profile(engine.latency_profile, settings.profiles_dir).latency
                prefill, decode = latency.prefill, latency.decode
            scale = engine.time_scale  # the engine runs this much faster than its profile
            prefill = (prefill[0] / scale, prefill[1] / scale, prefill[2] / scale)
            decode = (decode[0] / scale, decode[1] / scale, decode[2] / scale)
            self.models[engine.engine_id] = LatencyModel.from_prior(prefill, decode)
        self.levels = len(self.profile.priority.levels) if self.profile.priority else 0
        self.pending_by_priority: dict[int, int] = {}

    # -- classification --------------------------------------------------------------------------

    def classify(self, headers: Mapping[bytes, bytes], body_priority: int) -> tuple[SloTarget, int | None]:
        """The request's targets and its effective priority.

        The priority comes from ``x-priority`` or else the body's ``priority`` (vLLM's field);
        ``None`` when the request gave neither. With a priority profile it is clamped into the
        profile's levels, so every later use (queue order, pending counts, the mapper's windows)
        sees the same level the targets came from.
        """
        auth = headers.get(b"authorization")
        task = headers.get(b"x-slo-task")
        priority_header = headers.get(b"x-priority")
        priority: int | None = body_priority if body_priority else None
        if priority_header is not None and priority_header.lstrip(b"-").isdigit():
            priority = int(priority_header)
        if priority is not None and self.levels:
            priority = min(max(priority, 0), self.levels - 1)
        hints = SloHints(
            ttft_ms=_float(headers.get(b"x-slo-ttft-ms")),
            tpot_ms=_float(headers.get(b"x-slo-tpot-ms")),
            task=task.decode() if task else (self.key_tasks.get(auth) if auth else None),
            priority=priority,
            tenant=self.key_tenants.get(auth) if auth else None,
        )
        if self.mapping is None:
            return classify(hints, self.profile), priority
        target, self.mapping = classify_mapped(hints, self.profile, self.mapping)
        return target, priority

    # -- pending and completions -----------------------------------------------------------------

    def started(self, priority: int | None) -> None:
        """A request with ``priority`` entered the gateway (the mapper's contention rule counts it)."""
        if priority is None or self.mapping is None:
            return
        self.pending_by_priority[priority] = self.pending_by_priority.get(priority, 0) + 1
        self.mapping = set_pending(self.mapping, self.pending_by_priority)

    def left(self, priority: int | None) -> None:
        """The request counted by :meth:`started` left the gateway, however it ended."""
        if priority is None or self.mapping is None:
            return
        self.pending_by_priority[priority] = max(0, self.pending_by_priority.get(priority, 1) - 1)
        self.mapping = set_pending(self.mapping, self.pending_by_priority)

    def finished(
        self,
        target: SloTarget,
        priority: int | None,
        engine_id: str | None,
        ttft_s: float | None,
        tpot_s: float | None,
        queue_s: float,
        prompt_tokens: int,
        batch_tokens: int,
        batch_size: int,
        prefill_ahead: tuple[int, ...] = (),
    ) -> None:
        """Judge one request whose token timing is known (or that failed, ``ttft_s`` None).

        TPOT counts as met when the request was served and its mean inter-token time is within
        target, or it produced a single token (nothing to be late by).
        """
        cls = target.slo_class
        served = ttft_s is not None
        ttft_ok = ttft_s is not None and ttft_s <= target.ttft_s
        tpot_ok = served and (tpot_s is None or tpot_s <= target.tpot_s)
        metrics.SLO_OUTCOMES.labels(cls, "ttft", "met" if ttft_ok else "missed").inc()
        metrics.SLO_OUTCOMES.labels(cls, "tpot", "met" if tpot_ok else "missed").inc()
        metrics.SLO_OUTCOMES.labels(cls, "both", "met" if ttft_ok and tpot_ok else "missed").inc()
        if ttft_s is None or engine_id is None:
            return
        if self.mapping is not None and tpot_s is not None and priority is not None:
            self.mapping = observe_completion(self.mapping, priority, ttft_s, tpot_s, queue_s)
        model = self.models.get(engine_id)
        if model is None:
            return
        # The gateway sees whole requests, not engine steps. The first token comes once every prompt
        # that was ahead of this one on the engine and this one are prefilled: that is the batch.
        # The mean inter-token time approximates one decode step of the batch it ran in.
        prefill_s = ttft_s - queue_s
        if prefill_s > 0:
            model = model.observe_prefill(PrefillSample((*prefill_ahead, prompt_tokens), prefill_s))
        if tpot_s is not None and tpot_s > 0 and batch_size > 0:
            model = model.observe_decode(DecodeSample(batch_tokens, batch_size, tpot_s))
        count = self._observations.get(engine_id, 0) + 1
        self._observations[engine_id] = count
        if count % REFIT_EVERY == 0:
            model = model.refit()
            for name, value in zip(("a", "b", "c"), model.prefill, strict=True):
                metrics.LATENCY_COEFF.labels(engine_id, "prefill", name).set(value)
            for name, value in zip(("a", "b", "c"), model.decode, strict=True):
                metrics.LATENCY_COEFF.labels(engine_id, "decode", name).set(value)
            for stage, err in (("prefill", model.prefill_error()), ("decode", model.decode_error())):
                if not math.isnan(err):
                    metrics.LATENCY_ERROR.labels(engine_id, stage).set(err)
        self.models[engine_id] = model

    def coefficients(self, engine_id: str) -> tuple[Coeffs, Coeffs]:
        model = self.models.get(engine_id)
        if model is None:
            return DEFAULT_PREFILL, DEFAULT_DECODE
        return model.prefill, model.decode
