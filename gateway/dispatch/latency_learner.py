"""Per-engine latency models learnt from the engine's own steps, as the gateway sees them.

The mechanism behind :mod:`policies.latency_samples`. Every streamed token passes through
:meth:`Fleet.add_generated`, which hands it to :meth:`LatencyLearner.tokens` (the live relay and
the offline simulator both call it, at the moment each token arrives). Tokens of one engine that
arrive together are one engine step: the learner groups them into bursts and, when the next
burst begins, describes the finished step (:class:`~policies.latency_samples.StepView`: how long
it ran, which requests decoded in it and with what context, which prompts completed in it, whether
other prompts could have shared it) for the policy to turn into a prefill or decode sample.

Samples wait for the engine's next scrape: the engine's own counters for the interval
(:func:`~policies.latency_samples.check_interval`: steps run, tokens generated, preemptions,
prefix-cache hits) must agree with what the gateway saw, or the interval's samples are dropped.
Engines that export no counters (or no metrics at all) have their samples kept at once.

Kept samples go to per-engine rings; the engine's :class:`LatencyModel` is re-fitted once enough
new ones arrived (often at first, every :data:`REFIT_EVERY` at most), so the dispatcher's
coefficients follow the engine within a few hundred requests whatever the prior was.
Calibration probes (``gateway.fleet.calibration``) add their samples through
:meth:`LatencyLearner.add_samples`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gateway import metrics
from gateway.fleet.registry import EngineRecord, Fleet, RunningEntry
from policies.api import EngineState
from policies.latency_fit import Coeffs, DecodeSample, LatencyModel, PrefillSample
from policies.latency_samples import SeenInterval, StepView, check_interval, step_sample, whole_step

#: largest number of new samples between two re-fits of an engine's model
REFIT_EVERY = 64
#: once an engine's rings are full, at most one re-fit per this many seconds (a fit is ~3 ms of
#: numpy on the event loop; at 256 busy engines every-64-samples would take a core's fifth)
REFIT_MIN_INTERVAL_S = 10.0
#: prefill samples waiting for their scrape interval to be confirmed, per engine
PENDING_LIMIT = 512
#: decode samples kept per scrape interval (the interval's latest): a busy engine makes one
#: per step, far more than a fit needs, and every one kept brings the next re-fit closer
DECODE_PER_INTERVAL = 16
#: bursts of an interval remembered with their time (a scrape in flight for seconds at most)
BURSTS_KEPT = 1024
#: the most the path delay is taken to be (seconds): a prompt is never taken to have reached its
#: engine later than this after its send, whatever the health checks' round trips say
MAX_PATH_DELAY_S = 0.05

Clock = Callable[[], float]


@dataclass(slots=True)
class _Steps:
    """One engine's bursts of tokens (steps) and the samples waiting for its next scrape."""

    chunk_tokens: int | None
    #: False until the first token: no burst to close
    open: bool = False
    #: first and last event of the current burst; the previous burst's first event
    first_at: float = -math.inf
    last_at: float = -math.inf
    #: when the current burst's step began, and when the previous one's did
    start: float = -math.inf
    prev_start: float = -math.inf
    #: whether the previous burst was one whole step (its time is the current step's start)
    prev_whole: bool = False
    expected: int = 0
    decodes: int = 0
    context: int = 0
    prompts: list[int] = field(default_factory=list)
    #: earliest send among the requests whose first token is in this burst
    sent_min: float = math.inf
    #: entries already counted in this burst (a request may send several events in one step)
    marked: set[int] = field(default_factory=set)
    #: the gateway's view of the interval since the last scrape
    seen_steps: int = 0
    seen_tokens: int = 0
    #: the interval's latest bursts: when each came and its events (for the scrape window's count;
    #: bounded, since an engine whose scrapes fail has an interval that never ends)
    bursts: deque[list[float]] = field(default_factory=lambda: deque(maxlen=BURSTS_KEPT))
    #: steps and tokens seen while the last scrape was in flight
    unsure_steps: int = 0
    unsure_tokens: int = 0
    unclean: int = 0
    last_state: EngineState | None = None
    pending_prefill: deque[PrefillSample] = field(default_factory=lambda: deque(maxlen=PENDING_LIMIT))
    pending_decode: deque[DecodeSample] = field(default_factory=lambda: deque(maxlen=DECODE_PER_INTERVAL))
    #: the engine's path delay as of its last scrape (see _on_change)
    path_s: float = 0.0


@dataclass(slots=True)
class _Rings:
    prefill: deque[PrefillSample]
    decode: deque[DecodeSample]
    #: samples of each stage added since the last re-fit, and in all
    new_prefill: int = 0
    new_decode: int = 0
    total_prefill: int = 0
    total_decode: int = 0
    last_refit: float = -math.inf

    def due(self, min_samples: int) -> bool:
        """Re-fit often while a stage knows little (at 8, 16, 32, ... samples), then every
        :data:`REFIT_EVERY` new samples of either stage."""
        return any(
            new >= min(REFIT_EVERY, max(min_samples, total // 2))
            for new, total in ((self.new_prefill, self.total_prefill), (self.new_decode, self.total_decode))
        )


class LatencyLearner:
    """Every engine's latency model, its samples, and the step tracking that produces them."""

    def __init__(
        self,
        priors: Mapping[str, tuple[Coeffs, Coeffs]],
        chunk_tokens: Mapping[str, int | None] | None = None,
        capacity: int = 512,
    ) -> None:
        self.models: dict[str, LatencyModel] = {
            engine_id: LatencyModel.from_prior(prefill, decode, capacity=capacity)
            for engine_id, (prefill, decode) in priors.items()
        }
        self._rings = {
            engine_id: _Rings(deque(maxlen=capacity), deque(maxlen=capacity)) for engine_id in self.models
        }
        chunks = chunk_tokens or {}
        self._steps = {engine_id: _Steps(chunks.get(engine_id)) for engine_id in self.models}
        self._clock: Clock | None = None
        self._gap = 0.0
        self._fleet: Fleet | None = None
        #: engines whose samples need no scrape to confirm them (they export no metrics)
        self._unchecked: set[str] = set()

    # -- wiring ----------------------------------------------------------------------------------

    def attach(self, fleet: Fleet, clock: Clock, step_gap_s: float) -> None:
        """Watch ``fleet``'s streamed tokens and scrapes. ``clock`` is the drivers' time (the
        live gateway's monotonic clock, the simulator's virtual one); tokens of one engine less
        than ``step_gap_s`` apart belong to one engine step (0 on a virtual clock, where a
        step's tokens arrive at one instant)."""
        self._fleet = fleet
        self._clock = clock
        self._gap = step_gap_s
        fleet.token_observer = self
        fleet.listeners.append(self._on_change)
        self._unchecked = {
            engine_id for engine_id, record in fleet.records.items() if record.adapter.metrics_path is None
        }

    # -- reads -----------------------------------------------------------------------------------

    def coefficients(self, engine_id: str) -> tuple[Coeffs, Coeffs] | None:
        model = self.models.get(engine_id)
        return None if model is None else (model.prefill, model.decode)

    def sample_counts(self, engine_id: str) -> tuple[int, int]:
        """Prefill and decode samples the engine's rings hold now."""
        rings = self._rings[engine_id]
        return len(rings.prefill), len(rings.decode)

    # -- the hot path: one stream event -------------------------------------------------------------

    def tokens(self, record: EngineRecord, entry: RunningEntry, tokens: int) -> None:
        """``tokens`` content events arrived for ``entry`` on ``record``'s engine (called before
        the entry's count moves, so ``entry.generated`` is what it had before them)."""
        steps = self._steps.get(record.engine_id)
        if steps is None or self._clock is None:
            return
        now = self._clock()
        if not steps.open or now - steps.last_at > self._gap:
            if steps.open:
                self._close(record, steps, entry)
            self._begin(record, steps, entry, now)
        steps.last_at = now
        steps.seen_tokens += tokens
        if steps.bursts:  # (always, with the open burst kept over a scrape: never raise here)
            steps.bursts[-1][1] += tokens
        key = id(entry)
        if key in steps.marked:
            return
        steps.marked.add(key)
        if entry.generated == 0 and not entry.remote_kv:
            # (what the dispatcher expected the engine to find cached is not prefilled there)
            steps.prompts.append(entry.prompt_tokens - min(entry.cached_tokens, entry.prompt_tokens))
            # when the prompt reached the engine, on the clock its tokens are seen by: a request
            # goes there and its tokens come back over the same path (see _on_change)
            sent = entry.dispatched_at + steps.path_s
            if sent < steps.sent_min:
                steps.sent_min = sent
        else:
            if entry.generated == 0:
                # a P/D decode whose KV arrived joins the batch with a decode of its context
                steps.expected += 1
            steps.decodes += 1
            steps.context += entry.prompt_tokens + entry.generated

    def _begin(self, record: EngineRecord, steps: _Steps, entry: RunningEntry, now: float) -> None:
        steps.prev_start = steps.start
        # provisional: the step began as the previous burst arrived (see _close for an idle engine)
        steps.start = steps.first_at
        steps.first_at = now
        decoding = len(record.running) - len(record.unprefilled)
        if entry.generated == 0 and entry.prefilled:
            decoding -= 1  # its first token is this event: it was not decoding when the step began
        steps.expected = decoding
        steps.decodes = steps.context = 0
        steps.prompts = []
        steps.sent_min = math.inf
        steps.marked.clear()
        steps.open = True
        steps.seen_steps += 1
        steps.bursts.append([now, 0.0])

    def _close(self, record: EngineRecord, steps: _Steps, trigger: RunningEntry) -> None:
        start = steps.start
        known_start = steps.prev_whole
        if steps.expected == 0 and steps.prompts and steps.sent_min >= start:
            # nothing was decoding when this step began and its first prompt was sent after the
            # previous burst: the engine was idle and began with that send
            start = steps.start = steps.sent_min
            known_start = True
        other = (
            trigger.generated == 0
            and not trigger.remote_kv
            and id(trigger) not in steps.marked
            and trigger.dispatched_at + steps.path_s <= start
        )
        if not other:
            running = record.running
            for rid in record.unprefilled:
                waiting = running.get(rid)
                # (a decode still waiting for its KV computes nothing meanwhile)
                if (
                    waiting is not None
                    and not waiting.remote_kv
                    and waiting.dispatched_at + steps.path_s <= start
                ):
                    other = True
                    break
        view = StepView(
            seconds=steps.first_at - start,
            decodes=steps.decodes,
            decode_context=steps.context,
            expected_decodes=steps.expected,
            prompts=tuple(steps.prompts),
            prompts_fresh=steps.sent_min > steps.prev_start,
            other_prefill=other,
            spread_s=steps.last_at - steps.first_at,
            chunk_tokens=steps.chunk_tokens,
            follows_whole_step=known_start,
        )
        steps.prev_whole = whole_step(view)
        sample = step_sample(view)
        engine_id = record.engine_id
        if sample is None:
            steps.unclean += 1
        elif engine_id in self._unchecked:
            self._keep(engine_id, (sample,), "kept")
        elif isinstance(sample, PrefillSample):
            steps.pending_prefill.append(sample)
        else:
            steps.pending_decode.append(sample)

    # -- scrapes: confirm or drop the interval's samples ----------------------------------------------

    def _on_change(self, engine_id: str, what: str) -> None:
        if what != "state" or self._fleet is None:
            return
        steps = self._steps.get(engine_id)
        if steps is None:
            return
        record = self._fleet.records[engine_id]
        state = record.state
        # The engine's tokens reach the gateway some time after it made them (the network, a busy
        # relay) while prompts reach it some time after they were sent: a burst seen at t began
        # before t, and a prompt sent at s was there only after s. Compared on one clock, prompts
        # sent just before a step looked sent during the one before it: at 20 ms each way no
        # prefill sample was ever clean, and the prior stayed. A health check's round trip covers
        # the same path there and back with next to no work at the engine (a scrape's holds the
        # time to render and parse the metrics, tens of milliseconds on a busy engine, which read
        # as path would make every prefill sample that much short).
        steps.path_s = min(MAX_PATH_DELAY_S, self._fleet.path_delay(engine_id))
        # the relay counts events; an engine may send several tokens in one
        per_event = record.tokens_per_event
        late = [b for b in steps.bursts if b[0] >= record.scrape_sent_at]
        late_tokens = round(sum(b[1] for b in late) * per_event)
        seen = SeenInterval(
            steps.seen_steps,
            round(steps.seen_tokens * per_event),
            steps.unsure_steps + len(late),
            steps.unsure_tokens + late_tokens,
        )
        verdict = check_interval(steps.last_state, state, seen)
        steps.last_state = state
        steps.seen_steps = steps.seen_tokens = 0
        # the burst still open goes on taking this step's tokens (a scrape can land mid-step)
        still_open = steps.bursts[-1] if steps.open and steps.bursts else None
        steps.bursts.clear()
        if still_open is not None:
            steps.bursts.append(still_open)
        steps.unsure_steps, steps.unsure_tokens = len(late), late_tokens
        if steps.unclean:
            metrics.child(metrics.LATENCY_SAMPLES, engine_id, "step", "unclean").inc(steps.unclean)
            steps.unclean = 0
        for stage, pending, ok in (
            ("prefill", steps.pending_prefill, verdict.prefill),
            ("decode", steps.pending_decode, verdict.decode),
        ):
            if not pending:
                continue
            if ok:
                self._keep(engine_id, pending, "kept")
            else:
                metrics.child(metrics.LATENCY_SAMPLES, engine_id, stage, "refuted").inc(len(pending))
            pending.clear()

    def prefill_answered(self, record: EngineRecord, entry: RunningEntry, timed: bool = True) -> None:
        """A P/D prefill stage answered (both drivers call this as it does: the live flow when its
        answer is read, the offline simulator at its token). Not streamed, no token of it passes
        :meth:`tokens`: a prefill engine learnt nothing and kept its prior, which is what places
        the prefill pool. The interval's check counts its steps and its one token either way.
        Timed when it ran alone (the only request of this gateway on its engine from its send to
        its answer) in one step (a prompt within the engine's chunk): its time less the path
        there and back is a prefill sample, which waits for the engine's next scrape like a
        step's (its counters refute an interval whose prompts hit the prefix cache: a prompt
        found cached answers in milliseconds whatever its length). ``timed`` False: its time is
        not its prefill's (a bootstrap prefill answers once its KV has moved), only counted."""
        if self._fleet is None or self._clock is None:
            return
        engine_id = record.engine_id
        steps = self._steps.get(engine_id)
        if steps is None:
            return
        uncached = entry.prompt_tokens - min(max(entry.cached_tokens, 0), entry.prompt_tokens)
        chunk = steps.chunk_tokens
        stage_steps = max(1, -(-uncached // chunk)) if chunk else 1
        steps.seen_tokens += 1
        alone = (
            record.seats_taken() == 1 and entry.alone_since >= 0 and record.reservations == entry.alone_since
        )
        if not (alone and timed):
            # (beside other requests its steps may be theirs too: as many steps, or none, more)
            steps.unsure_steps += stage_steps
            return
        steps.seen_steps += stage_steps
        if stage_steps > 1:
            return  # (several steps, none of them timed: as step_sample leaves a chunked prompt)
        path = min(MAX_PATH_DELAY_S, self._fleet.path_delay(engine_id))
        seconds = self._clock() - entry.dispatched_at - path
        if seconds <= 0.0:
            return
        sample = PrefillSample((uncached,), seconds)
        if engine_id in self._unchecked:
            self._keep(engine_id, (sample,), "kept")
        else:
            steps.pending_prefill.append(sample)

    # -- samples into rings, rings into models --------------------------------------------------------

    def add_samples(
        self, engine_id: str, samples: Iterable[PrefillSample | DecodeSample], refit: bool = True
    ) -> None:
        """Samples measured some other way (calibration probes): kept at once, and the model is
        re-fitted right away unless ``refit`` is False."""
        if engine_id not in self._rings:
            return
        self._keep(engine_id, tuple(samples), "calibration")
        if refit:
            self.refit(engine_id)

    def _keep(self, engine_id: str, samples: Iterable[PrefillSample | DecodeSample], outcome: str) -> None:
        rings = self._rings[engine_id]
        prefill = decode = 0
        for sample in samples:
            if isinstance(sample, PrefillSample):
                rings.prefill.append(sample)
                prefill += 1
            else:
                rings.decode.append(sample)
                decode += 1
        if prefill:
            metrics.child(metrics.LATENCY_SAMPLES, engine_id, "prefill", outcome).inc(prefill)
        if decode:
            metrics.child(metrics.LATENCY_SAMPLES, engine_id, "decode", outcome).inc(decode)
        rings.new_prefill += prefill
        rings.new_decode += decode
        rings.total_prefill += prefill
        rings.total_decode += decode
        if rings.due(self.models[engine_id].min_samples) and self._may_refit(rings):
            self.refit(engine_id)

    def _may_refit(self, rings: _Rings) -> bool:
        full = len(rings.prefill) == rings.prefill.maxlen or len(rings.decode) == rings.decode.maxlen
        if not full or self._clock is None:
            return True
        now = self._clock()
        if now - rings.last_refit < REFIT_MIN_INTERVAL_S:
            return False
        rings.last_refit = now
        return True

    def refit(self, engine_id: str) -> LatencyModel:
        """Re-fit the engine's model on its rings now, publish its coefficients, and return it."""
        rings = self._rings[engine_id]
        rings.new_prefill = rings.new_decode = 0
        model = replace(
            self.models[engine_id], prefill_samples=tuple(rings.prefill), decode_samples=tuple(rings.decode)
        ).refit()
        # the rings live here; the model keeps only its coefficients (copying them per fit is enough)
        model = replace(model, prefill_samples=(), decode_samples=())
        self.models[engine_id] = model
        for name, value in zip(("a", "b", "c"), model.prefill, strict=True):
            metrics.LATENCY_COEFF.labels(engine_id, "prefill", name).set(value)
        for name, value in zip(("a", "b", "c"), model.decode, strict=True):
            metrics.LATENCY_COEFF.labels(engine_id, "decode", name).set(value)
        fitted = replace(model, prefill_samples=tuple(rings.prefill), decode_samples=tuple(rings.decode))
        for stage, err in (("prefill", fitted.prefill_error()), ("decode", fitted.decode_error())):
            if not math.isnan(err):
                metrics.LATENCY_ERROR.labels(engine_id, stage).set(err)
        return model
