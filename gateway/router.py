"""Engine selection for one request: snapshot the fleet, run the routing pipeline, time the plugins.

The pipeline itself is pure (``policies.pipeline``); this module owns the mutable picker state
and the metric for each plugin call, so policies never see a clock or a metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

import yaml

from gateway import metrics
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.fleet.registry import EngineRecord, Fleet
from policies.api import EngineSnapshot, Filter, Picker, PolicyConfigError, RequestView, Scorer
from policies.pipeline import RoutingPipeline, WeightedScorer, compile_profile
from policies.plugins.load import LeastLoad
from policies.plugins.lora import NAME as LORA
from policies.plugins.lora import LoraAffinity, with_adapter
from policies.plugins.pickers import MaxScore

_load = attrgetter("load")


class _TimedFilter:
    def __init__(self, name: str, inner: Filter) -> None:
        self.inner = inner
        self.hist = metrics.deferred(metrics.POLICY_CALL, f"filter:{name}")

    def filter(
        self, request: RequestView, engines: Sequence[EngineSnapshot], now: float
    ) -> Sequence[EngineSnapshot]:
        t0 = time.perf_counter()
        try:
            return self.inner.filter(request, engines, now)
        finally:
            self.hist.observe(time.perf_counter() - t0)


class _TimedScorer:
    def __init__(self, name: str, inner: Scorer) -> None:
        self.inner = inner
        self.hist = metrics.deferred(metrics.POLICY_CALL, f"scorer:{name}")

    def score(self, request: RequestView, engines: Sequence[EngineSnapshot], now: float) -> Sequence[float]:
        t0 = time.perf_counter()
        try:
            return self.inner.score(request, engines, now)
        finally:
            self.hist.observe(time.perf_counter() - t0)


class _TimedPicker:
    def __init__(self, name: str, inner: Picker) -> None:
        self.inner = inner
        self.hist = metrics.deferred(metrics.POLICY_CALL, f"picker:{name}")

    def initial_state(self) -> object:
        return self.inner.initial_state()

    def pick(
        self, request: RequestView, engines: Sequence[EngineSnapshot], scores: Sequence[float], state: object
    ) -> tuple[EngineSnapshot, object]:
        t0 = time.perf_counter()
        try:
            return self.inner.pick(request, engines, scores, state)
        finally:
            self.hist.observe(time.perf_counter() - t0)


def load_pipeline(path: Path) -> RoutingPipeline:
    """Compile a routing profile file; raises PolicyConfigError with the file named."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise PolicyConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise PolicyConfigError(f"{path}: a routing profile must be a mapping")
    try:
        return compile_profile(data)
    except ValueError as exc:
        raise PolicyConfigError(f"{path}: {exc}") from None


def timed(pipeline: RoutingPipeline) -> RoutingPipeline:
    """The same pipeline with every plugin call recorded in ``slogate_policy_call_seconds``."""
    return RoutingPipeline(
        filters=tuple((name, _TimedFilter(name, f)) for name, f in pipeline.filters),
        scorers=tuple(
            WeightedScorer(s.name, _TimedScorer(s.name, s.scorer), s.weight) for s in pipeline.scorers
        ),
        picker_name=pipeline.picker_name,
        picker=_TimedPicker(pipeline.picker_name, pipeline.picker),
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """Why a request went where it did: the engine, the policy and each scorer's value there,
    and what the prefix index and the affinity store knew (``x-slogate-decision``)."""

    engine_id: str
    policy: str
    scores: tuple[tuple[str, float], ...] = ()
    #: leading prompt tokens the index held on the engine, of the prompt's (None: not keyed)
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    #: the session's engine before this choice (None: no session key or no engine known)
    session_engine: str | None = None

    def header(self) -> bytes:
        parts = [f"engine={self.engine_id}", f"policy={self.policy}"]
        parts.extend(f"{name}={value:.3f}" for name, value in self.scores)
        if self.cached_tokens is not None:
            parts.append(f"cached_tokens={self.cached_tokens}/{self.prompt_tokens}")
        if self.session_engine is not None:
            parts.append(f"session_engine={self.session_engine}")
        return "; ".join(parts).encode("ascii", "replace")

    def attributes(self) -> dict[str, str | float | int]:
        """The same as span attributes (``slogate.decision.*``)."""
        out: dict[str, str | float | int] = {"slogate.decision.policy": self.policy}
        out.update({f"slogate.decision.score.{name}": round(value, 6) for name, value in self.scores})
        if self.cached_tokens is not None and self.prompt_tokens is not None:
            out["slogate.decision.cached_tokens"] = self.cached_tokens
            out["slogate.decision.prompt_tokens"] = self.prompt_tokens
        if self.session_engine is not None:
            out["slogate.decision.session_engine"] = self.session_engine
        return out


class Router:
    """Chooses an engine for a request from the current fleet snapshot.

    With ``prefix`` (the prefix index and the affinity store), the request view the pipeline sees
    carries each candidate's cached prefix and the session's last engine, and every choice is
    recorded back into both.
    """

    def __init__(
        self,
        fleet: Fleet,
        pipeline: RoutingPipeline,
        prefix: PrefixRouting | None = None,
        policy: str = "pipeline",
    ) -> None:
        self.fleet = fleet
        # LoRA affinity is applied to every adapter request, before exclusions and the rest of
        # the pipeline: the profile's own lora_affinity filter (its parameters) or the default
        listed = [f for name, f in pipeline.filters if name == LORA]
        own = listed[0] if listed else None
        self.lora: LoraAffinity = own if isinstance(own, LoraAffinity) else LoraAffinity()
        if listed:
            pipeline = replace(pipeline, filters=tuple(f for f in pipeline.filters if f[0] != LORA))
        self._lora_hist: Any = None  # made with the first adapter request (no series before)
        self.pipeline = timed(pipeline)
        self.prefix = prefix
        #: the routing profile's name, as decisions report it
        self.policy = policy
        #: requests whose decisions are wanted (``x-slogate-debug``): request id -> receiver
        self._explain: dict[str, Callable[[Decision], None]] = {}
        #: each model's picker state (its rotation among equal engines, its seed): one shared by
        #: every model let a client alternating models pin each model's ties to one engine
        self._picker_states: dict[str, object] = {}
        self._tie_offset = 0
        # a profile that picks by one key over unit-weight engines (least load, max_score): the
        # fleet keeps engines grouped by that key and a placement takes the best group's next
        # engine in max_score's rotation, without scoring every engine; weights
        # would make the key and the load limit disagree, so they keep the full pass
        key = pipeline.rank_key()
        self._ranked = key is not None and all(r.adapter.config.weight == 1.0 for r in fleet.records.values())
        if key is not None and self._ranked:
            # (with unit weights least load's key is the entry's load: kept current as reserved)
            fleet.rank_by(key, by_load=key is LeastLoad.rank_key)
        # a ranked choice calls no plugin; it is timed whole, under the scorer it stands for
        self._ranked_hist: Any = (
            metrics.deferred(metrics.POLICY_CALL, f"ranked:{pipeline.scorers[0].name}")
            if self._ranked
            else None
        )

    def offset_ties(self, offset: int) -> None:
        """Start the rotation among equally good engines ``offset`` places on. Gateway replicas in
        front of the same engines see the same loads (shared through the state store): with the
        same rotation, arrivals at two replicas at once went to the same one of several equally
        loaded engines, and took its last seat twice."""
        # (max_score's state is that rotation's counter; other pickers' states are seeds or
        # structures, which an offset would reseed or miss: left as they are)
        self._tie_offset += offset
        for model, state in self._picker_states.items():
            if self._offsets(state):
                self._picker_states[model] = state + offset  # type: ignore[operator]

    def _offsets(self, state: object) -> bool:
        picker = self.pipeline.picker
        inner = picker.inner if isinstance(picker, _TimedPicker) else picker
        return (self._ranked or type(inner) is MaxScore) and isinstance(state, int)

    def _picker_state(self, model: str) -> object:
        state = self._picker_states.get(model)
        if state is None:
            state = self.pipeline.picker.initial_state()
            if self._offsets(state):
                state += self._tie_offset  # type: ignore[operator]
            self._picker_states[model] = state
        return state

    def choose(
        self,
        request: RequestView,
        exclude: Collection[str] = (),
        max_load: float | None = None,
        now: float | None = None,
    ) -> EngineRecord | None:
        """The pipeline's engine for ``request`` among healthy engines of its model, without
        those in ``exclude`` and, when ``max_load`` is set, those already that loaded."""
        now = time.monotonic() if now is None else now
        if self._ranked and not exclude and request.lora is None and request.engine is None:
            t0 = time.perf_counter()
            routable, slots, least = self.fleet.least_ranked(request.model, now)
            if not slots or (max_load is not None and least >= max_load):
                # no engine, or the least loaded engine is full, so every engine is
                self._ranked_hist.observe(time.perf_counter() - t0)
                return None
            index, self._picker_states[request.model] = MaxScore.rotate(
                len(slots), self._picker_state(request.model)
            )
            record = routable[slots[index]]
            self._ranked_hist.observe(time.perf_counter() - t0)
            if self._explain:
                self._decided(request, self.fleet.candidates(request.model, now), record.engine_id, now)
            if self.prefix is not None:
                self.prefix.dispatched(request.request_id, record.engine_id, now)
            return record
        candidates: Sequence[EngineSnapshot] = self.fleet.candidates(request.model, now)
        if request.lora is not None:
            # before the exclusions: a retry whose engines with the adapter all failed finds none
            candidates = self.with_lora(request.lora, candidates)
        if request.engine is not None:
            candidates = [e for e in candidates if e.engine_id == request.engine]
        if exclude:
            candidates = [e for e in candidates if e.engine_id not in exclude]
        if not candidates:
            return None
        if max_load is not None and min(candidates, key=_load).load >= max_load:
            return None  # every engine is full: the common answer under overload, in one C-level pass
        if self.prefix is not None:
            request = self.prefix.annotate(request, candidates, now)
        before = self._picker_state(request.model)
        chosen, state = self.pipeline.choose(request, candidates, before, now)
        if chosen is not None and max_load is not None and not chosen.load < max_load:
            # the pipeline's favourite is full; only then pay for the room filter and ask again
            candidates = [e for e in candidates if e.load < max_load]
            if not candidates:
                return None
            chosen, state = self.pipeline.choose(request, candidates, before, now)
        self._picker_states[request.model] = state
        if chosen is None:
            return None
        if self._explain:
            self._decided(request, candidates, chosen.engine_id, now)
        if self.prefix is not None:
            self.prefix.dispatched(request.request_id, chosen.engine_id, now)
        return self.fleet.records[chosen.engine_id]

    def with_lora(self, lora: str, engines: Sequence[EngineSnapshot]) -> Sequence[EngineSnapshot]:
        """``engines`` that may take a request for LoRA adapter ``lora`` under this profile (the
        ``lora_affinity`` filter: those that have it loaded when any has, unless the profile says
        the engines load adapters on demand)."""
        if not self.lora.required:
            return engines
        if self._lora_hist is None:
            self._lora_hist = metrics.deferred(metrics.POLICY_CALL, f"filter:{LORA}")
        t0 = time.perf_counter()
        try:
            chosen = with_adapter(engines, lora)
            if chosen is engines and engines and self.fleet.adapter_base(lora) is not None:
                # none of these has it, but an engine out of rotation lists it (ejected, drained,
                # stalled: its adapters are kept for its return): any of these would answer 404
                # "does not exist", which clients take as final; none, so it waits or gets a 503
                return ()
            return chosen
        finally:
            self._lora_hist.observe(time.perf_counter() - t0)

    def assigned(self, request: RequestView, engine_id: str, now: float) -> None:
        """Another dispatcher (HyperFlexis) placed ``request`` on ``engine_id``: the prefix index
        and the affinity store learn it as they do from :meth:`choose`."""
        if self._explain and request.request_id in self._explain:
            view = (
                request
                if self.prefix is None
                else self.prefix.annotate(request, self.fleet.candidates(request.model, now), now)
            )
            self._explain[request.request_id](self._decision(view, engine_id, self.policy, ()))
        if self.prefix is not None:
            self.prefix.dispatched(request.request_id, engine_id, now)

    # -- decisions, for requests that ask (x-slogate-debug) -----------------------------------------

    def explain(self, request_id: str, receiver: Callable[[Decision], None]) -> None:
        """Hand ``request_id``'s next decision to ``receiver`` (each retry's decision again)."""
        self._explain[request_id] = receiver

    def forget(self, request_id: str) -> None:
        self._explain.pop(request_id, None)

    def _decided(
        self, request: RequestView, candidates: Sequence[EngineSnapshot], engine_id: str, now: float
    ) -> None:
        receiver = self._explain.get(request.request_id)
        if receiver is None:
            return
        if self.prefix is not None and request.prefix is None and request.affinity is None:
            request = self.prefix.annotate(request, candidates, now)
        scores = tuple(self.pipeline.explain(request, candidates, engine_id, now))
        receiver(self._decision(request, engine_id, self.policy, scores))

    @staticmethod
    def _decision(
        request: RequestView, engine_id: str, policy: str, scores: tuple[tuple[str, float], ...]
    ) -> Decision:
        prefix = request.prefix
        return Decision(
            engine_id,
            policy,
            scores,
            cached_tokens=None if prefix is None else prefix.cached_tokens.get(engine_id, 0),
            prompt_tokens=None if prefix is None else prefix.prompt_tokens,
            session_engine=None if request.affinity is None else request.affinity.engine_id,
        )
