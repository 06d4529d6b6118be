"""Calibration: a short set of probes that seeds an engine's latency model when it joins or idles.

Off unless ``calibration`` is set. When an engine becomes healthy, and again once it has been idle
for ``calibration_interval_s`` since its last calibration, the gateway sends it, through the same
upstream session, adapter, URL and headers as client requests:

* prefill probes: prompts of :data:`PROMPT_TOKENS` tokens with ``max_tokens`` 1, one at a time,
  timed from send to answer (the engine's own ``usage.prompt_tokens`` gives each prompt's length),
  :data:`PREFILL_REPEATS` fresh prompts per length of which the fastest is kept (a hiccup of the
  gateway's host or the network only ever adds time, and one would bend the fitted fixed cost);
* decode probes: :data:`DECODE_BATCHES` streams at once, :data:`DECODE_TOKENS` tokens each
  (``ignore_eos``), whose inter-token gaps, while every stream of the batch is decoding, are
  decode steps of that batch size.

Their samples go straight to the engine's model (:meth:`LatencyLearner.add_samples`), which is
re-fitted at once. Probes are not client traffic: they never pass the front door, the dispatcher
or SLO accounting (their ids start ``sg-calibration-``; ``slogate_calibration_probes_total``
counts them), and they never hold client capacity: the gateway reserves nothing for them, probes
only an engine with no client request on it, and abandons the run (its timings unused) as soon as
a client request reaches that engine. The task stops with the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway import metrics
from gateway.dispatch.latency_learner import LatencyLearner
from gateway.engines.base import read_control
from gateway.experiments.prompts import derive_seed, segment_tokens
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.sse import sse_data
from gateway.tasks import cancel_and_wait
from gateway.tokenizer import decode
from policies.api import Role
from policies.latency_fit import DecodeSample, PrefillSample

log = logging.getLogger("slogate.calibration")

#: prompt lengths of the prefill probes (tokens, about: the engine's count is used)
PROMPT_TOKENS = (8, 32, 64, 128, 256, 512, 768, 1024)
#: prefill probes per prompt length (the fastest is the sample)
PREFILL_REPEATS = 2
#: (concurrent streams, prompt tokens each) of the decode probes
DECODE_BATCHES = ((1, 16), (1, 512), (4, 64))
#: tokens each decode probe asks for
DECODE_TOKENS = 16
#: a decode gap off its stream's median by more than this factor is a hiccup (the gateway's or the
#: network's) or not one step (a token that carried no text, the final chunk)
_GAP_OUTLIER = 1.5
_ERRORS = (aiohttp.ClientError, TimeoutError, OSError, ValueError)
#: the first wait after client traffic interrupted a run; doubled after each one, up to the interval
INTERRUPTED_WAIT_S = 5.0


class Interrupted(Exception):
    """A client request reached the engine while it was being probed."""


@dataclass(slots=True)
class _Watch:
    """Client activity on one engine since a probe run began (the fleet's change events)."""

    engine_id: str
    touched: bool = False


@dataclass(slots=True)
class _Stream:
    prompt_tokens: int
    times: list[float] = field(default_factory=list)


class Calibrator:
    """Probes engines when they join or idle (see the module doc); :meth:`start` / :meth:`stop`."""

    def __init__(
        self,
        fleet: Fleet,
        learner: LatencyLearner,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        check_every_s: float = 1.0,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.learner = learner
        self.session = session
        self.interval_s = interval_s
        self.check_every_s = check_every_s
        self.clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        #: when each engine is next due (now: it has not been calibrated since it joined)
        self.due: dict[str, float] = dict.fromkeys(fleet.records, -math.inf)
        #: the engines calibrated, latest last (a log for tests and operators: bounded)
        self.done: deque[str] = deque(maxlen=1024)
        #: per engine, how long to wait after a run that client traffic interrupted
        self._backoff: dict[str, float] = {}
        self._watches: list[_Watch] = []
        self._task: asyncio.Task[None] | None = None
        self._count = 0
        # prompts differ from every earlier run's too (a restarted gateway must not hit the
        # engine's prefix cache with the probes it sent before)
        self._nonce = random.getrandbits(64)
        fleet.listeners.append(self._on_change)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="calibration")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def _on_change(self, engine_id: str, what: str) -> None:
        # ("role": a drain began or ended, or the role changed; a flip needs no reservation to
        # drain past the probes, and one that ended between two probes left a run measuring the
        # engine across its flip, then in its new role)
        if what in ("release", "prefilled", "role"):
            for watch in self._watches:
                if watch.engine_id == engine_id:
                    watch.touched = True
        elif what == "health":
            record = self.fleet.records[engine_id]
            if record.healthy:
                self.due[engine_id] = -math.inf  # (re)joined: calibrate it when it is idle

    async def _loop(self) -> None:
        while True:
            for engine_id, record in self.fleet.records.items():
                if self.due.get(engine_id, math.inf) <= self.clock() and self._idle(record):
                    try:
                        await self.calibrate(record)
                    except Interrupted:
                        # still due, but not at the next idle moment: under load each brief one
                        # began a run that was abandoned, probes sent for nothing every second
                        wait = min(self.interval_s, 2 * self._backoff.get(engine_id, INTERRUPTED_WAIT_S / 2))
                        self._backoff[engine_id] = wait
                        self.due[engine_id] = self.clock() + wait
                        continue
                    except Exception:  # a probe bug must not stop calibration of the others
                        log.exception("calibration of %s failed", engine_id)
                    self._backoff.pop(engine_id, None)
                    self.due[engine_id] = self.clock() + self.interval_s
            await asyncio.sleep(self.check_every_s)

    @staticmethod
    def _idle(record: EngineRecord) -> bool:
        # (a draining engine is about to change role: its probes would meet the flip)
        # (no request of any gateway replica's there, as last heard: seats_taken counts theirs)
        # (nor one out of rotation for a stall or failed requests: its probes would wait out
        # their timeouts, or fail, while every other engine waits for its turn)
        return (
            record.healthy
            and not record.seats_taken()
            and not record.draining
            and not record.stalled
            and not record.tripped
            and record.adapter.role is Role.COLLOCATED
        )

    # -- one engine --------------------------------------------------------------------------------

    async def calibrate(self, record: EngineRecord) -> int:
        """Probe ``record``'s engine and add what was measured to its model; returns the samples
        added. Raises :class:`Interrupted` (nothing added) if a client request reached the engine
        meanwhile; failed probes are skipped."""
        watch = _Watch(record.engine_id)
        self._watches.append(watch)
        try:
            samples: list[PrefillSample | DecodeSample] = []
            for n in PROMPT_TOKENS:
                timed = [await self._prefill(record, watch, n) for _ in range(PREFILL_REPEATS)]
                fastest = min((t for t in timed if t is not None), key=lambda t: t.seconds, default=None)
                if fastest is not None:
                    samples.append(fastest)
            for batch, prompt in DECODE_BATCHES:
                samples.extend(await self._decode(record, watch, batch, prompt))
        finally:
            self._watches.remove(watch)
        self.learner.add_samples(record.engine_id, samples)
        self.done.append(record.engine_id)
        coefficients = self.learner.coefficients(record.engine_id)
        log.info(
            "calibrated %s with %d samples: %s",
            record.engine_id,
            len(samples),
            coefficients,
            extra={"engine": record.engine_id},
        )
        return len(samples)

    def _check(self, record: EngineRecord, watch: _Watch) -> None:
        # (a drain began: a role flip is coming, and the probes would meet it; ejected: each
        # probe left would wait out its timeout while every other engine waits for its turn)
        if (
            watch.touched
            or record.seats_taken()
            or record.draining
            or record.stalled
            or record.tripped
            or not record.healthy
            or record.adapter.role is not Role.COLLOCATED
        ):
            metrics.child(metrics.CALIBRATION_PROBES, record.engine_id, "interrupted").inc()
            raise Interrupted(record.engine_id)

    def _request(self, record: EngineRecord, body: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        self._count += 1
        adapter = record.adapter
        headers = adapter.upstream_headers(f"sg-calibration-{record.engine_id}-{self._count}")
        return adapter.url("/v1/completions"), orjson.dumps(body), headers

    def _prompt(self, record: EngineRecord, tokens: int) -> str:
        # fresh words every time: a probe must not hit the engine's prefix cache
        self._count += 1
        seed = derive_seed("calibration", self._nonce, record.engine_id, self._count)
        return decode(list(segment_tokens(seed, tokens)))

    async def _prefill(self, record: EngineRecord, watch: _Watch, tokens: int) -> PrefillSample | None:
        self._check(record, watch)
        body = {
            "model": record.model,
            "prompt": self._prompt(record, tokens),
            "max_tokens": 1,
            "temperature": 0,
        }
        url, payload, headers = self._request(record, body)
        started = self.clock()
        try:
            async with self.session.post(
                url, data=payload, headers=headers, timeout=self._timeout, allow_redirects=False
            ) as resp:
                data = await read_control(resp)
                ok = resp.status == 200
        except _ERRORS:
            ok, data = False, b""
        elapsed = self.clock() - started
        self._check(record, watch)
        if not ok:
            metrics.child(metrics.CALIBRATION_PROBES, record.engine_id, "failed").inc()
            return None
        metrics.child(metrics.CALIBRATION_PROBES, record.engine_id, "ok").inc()
        counted = _prompt_tokens(data, tokens)
        return PrefillSample((counted if counted else tokens,), elapsed)

    async def _decode(
        self, record: EngineRecord, watch: _Watch, batch: int, prompt: int
    ) -> list[DecodeSample]:
        self._check(record, watch)
        streams = [_Stream(prompt) for _ in range(batch)]
        results = await asyncio.gather(*(self._stream(record, s) for s in streams))
        self._check(record, watch)
        for ok in results:
            metrics.child(metrics.CALIBRATION_PROBES, record.engine_id, "ok" if ok else "failed").inc()
        if not all(results) or any(len(s.times) < 3 for s in streams):
            return []
        # steps in which every stream of the batch decoded: after the last first token, up to
        # the first stream's end
        begin = max(s.times[0] for s in streams)
        end = min(s.times[-1] for s in streams)
        samples = []
        for stream in streams:
            gaps = [
                (b - a, i)
                for i, (a, b) in enumerate(zip(stream.times, stream.times[1:], strict=False))
                if a >= begin and b <= end
            ]
            if not gaps:
                continue
            typical = statistics.median(g for g, _ in gaps)
            for gap, i in gaps:
                if typical / _GAP_OUTLIER <= gap <= _GAP_OUTLIER * typical:
                    # every stream is at about the same point: prompt + tokens so far, batch-wide
                    context = sum(s.prompt_tokens + i + 1 for s in streams)
                    samples.append(DecodeSample(context, batch, gap))
        return samples

    async def _stream(self, record: EngineRecord, stream: _Stream) -> bool:
        body = {
            "model": record.model,
            "prompt": self._prompt(record, stream.prompt_tokens),
            "max_tokens": DECODE_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url, payload, headers = self._request(record, body)
        try:
            async with self.session.post(
                url, data=payload, headers=headers, timeout=self._timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return False  # (its body unread: the connection is closed, not reused)
                pending = b""
                async for chunk in resp.content.iter_any():
                    now = self.clock()
                    pending += chunk
                    *events, pending = pending.split(b"\n\n")
                    if len(pending) > MAX_EVENT_BYTES or len(stream.times) + len(events) > MAX_STREAM_EVENTS:
                        return False  # (an engine streaming without end, or one endless event)
                    for event in events:
                        payload = sse_data(event)
                        if not event.startswith(b"data:") or payload.strip() == b"[DONE]":
                            continue
                        if b'"choices":[]' in payload:  # the usage-only chunk
                            counted = _prompt_tokens(payload, stream.prompt_tokens)
                            if counted:
                                stream.prompt_tokens = counted
                            continue
                        stream.times.append(now)
        except _ERRORS:
            return False
        return True


#: how far an engine's count of a probe's prompt may be from the gateway's before it is not
#: believed (tokenizers differ, by far less than this)
COUNT_FACTOR = 4


#: a probe stream's events: those it asks for (one a token, and the usage), with room to spare;
#: an engine streaming without end or one event without end fails the probe, not the memory
MAX_STREAM_EVENTS = 4 * DECODE_TOKENS
MAX_EVENT_BYTES = 1 << 20


def _prompt_tokens(body: bytes, sent: int) -> int | None:
    """The prompt tokens the engine computed for a completion (or usage chunk), if it says:
    ``usage.prompt_tokens`` less any ``prompt_tokens_details.cached_tokens``; None also when
    that is not within :data:`COUNT_FACTOR` of ``sent``, the gateway's count (one sample of a
    broken engine's 2^64 crushed the fitted per-token cost 28x)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    value = usage.get("prompt_tokens")
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not sent / COUNT_FACTOR <= value <= sent * COUNT_FACTOR
    ):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and 0 < cached < value:
        value -= cached
    return value
