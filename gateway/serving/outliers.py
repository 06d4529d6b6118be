"""Outlier ejection on the data path: an engine whose requests fail in a row is taken out of
rotation for a while (the rule and its numbers: :mod:`policies.outliers`).

The serving flows tell it each request's verdict on its engine (:meth:`OutlierEjector.judge`):
a failure is the engine's (a 5xx it answered, a connection it cut, a stream that stalled or was
cut, an answer that did not come in time); a success is any answer the engine gave (a 4xx is the
client's). What says nothing of the engine (a client that left, an overloaded engine's 503, the
gateway's own shortage) counts for neither. Back in rotation after its time, an engine is on
probation: one more failure takes it out again, for twice as long; one success clears it.

A failure another engine may still mend (a retry follows) counts only if it does: a request that
fails on every engine it tries is likely at fault itself (:meth:`OutlierEjector.settle`). A final
500, which no other engine tries (a P/D decode stage's: the engine may have read the KV handed
over), counts as it comes, as an Envoy-style consecutive-5xx rule counts it: left out, a decode
engine answering 500 to every request was never taken out, and decode placement, which always
found it least loaded (it failed at once), sent it every request of the model. Only failures in a
row count (any answer clears them), and never more than the pool's share is out. Other final
errors count for no engine (:func:`raised_verdict`).
"""

from __future__ import annotations

import asyncio
import logging

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.fleet.registry import Fleet
from gateway.serving.call import Call
from gateway.serving.stream_state import Cut
from policies.api import Role
from policies.migration import MigrationReason
from policies.outliers import OutlierParams, ejection_s, may_eject

log = logging.getLogger("slogate.outliers")

#: 5xx codes that say nothing of the engine's answers: it refused the gateway's key (the monitor
#: takes it out), or the gateway itself is short of connections
NOT_THE_ENGINES = frozenset(("upstream_auth_failed", "gateway_overloaded"))
#: error codes that are the engine's failure (see gateway/serving/relay.py and collocated.py)
ENGINE_FAULTS = frozenset(
    ("upstream_failed", "upstream_timeout", "upstream_too_large", "upstream_unreachable")
)


def verdict(outcome: int | GatewayError | Cut | BaseException) -> bool | None:
    """What an attempt's outcome says of its engine: True it answered, False it failed, None
    nothing (the client left, the engine was overloaded or refused the gateway's key); for an
    exception raised out of an attempt see :func:`raised_verdict`."""
    if isinstance(outcome, Cut):
        return None if outcome.reason is MigrationReason.SLACK else False
    if isinstance(outcome, int):
        return outcome < 500
    if isinstance(outcome, GatewayError):
        if outcome.code in ENGINE_FAULTS:
            return False
        if outcome.code in NOT_THE_ENGINES:
            return None
        if outcome.status in (500, 502, 504):
            return False  # (the engine's own error answer)
        return True if outcome.status < 500 else None
    return None


def raised_verdict(exc: BaseException) -> bool | None:
    """What an exception raised out of an attempt says of its engine: a 4xx (the engine answered:
    the client's fault) clears; the engine's own 500 (a P/D decode stage's, final) fails; anything
    else says nothing: a client that left, a cancellation, the gateway's own shortage, an
    overloaded engine's 503, and the final 502s and 504s, which are not the engine's alone (a
    shared deadline's timeout blames whichever engine got the time left after the queue and
    earlier attempts, an answer past the gateway's size limit is the client's asking, a proxy's
    502 or 504 may come after the engine did its work)."""
    if not isinstance(exc, GatewayError):
        return None
    if 400 <= exc.status < 500:
        return True
    return False if exc.status == 500 and exc.code not in NOT_THE_ENGINES else None


class OutlierEjector:
    def __init__(self, fleet: Fleet, params: OutlierParams) -> None:
        self.fleet = fleet
        self.params = params
        #: failed requests in a row, per engine
        self._streak: dict[str, int] = {}
        #: ejections in a row (no success since), per engine
        self._ejections: dict[str, int] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def judge(self, engine_id: str, outcome: int | GatewayError | Cut, call: Call) -> None:
        """An attempt of ``call`` on the engine ended so. A failure before anything reached the
        client (a retryable error) waits for the request's end (:meth:`settle`): a request that
        fails on every engine it tries is likely at fault itself, not they."""
        said = verdict(outcome)
        if said is True:
            self._streak.pop(engine_id, None)
            self._ejections.pop(engine_id, None)
        elif said is False:
            if isinstance(outcome, GatewayError):
                if call.failed_on is None:
                    call.failed_on = []
                call.failed_on.append(engine_id)
            else:
                self._failed(engine_id)

    def judge_raised(self, engine_id: str, exc: BaseException) -> None:
        """An attempt raised ``exc`` (a final answer, a client that left, a cancellation)."""
        said = raised_verdict(exc)
        if said is True:
            self._streak.pop(engine_id, None)
            self._ejections.pop(engine_id, None)
        elif said is False:
            self._failed(engine_id)

    def settle(self, call: Call, status: int) -> None:
        """The request ended with ``status``: the engines it failed on before being served
        elsewhere count those failures (not when no engine served it)."""
        failed, call.failed_on = call.failed_on, None
        if failed and 200 <= status < 300:
            for engine_id in failed:
                self._failed(engine_id)

    def _failed(self, engine_id: str) -> None:
        params = self.params
        if params.consecutive_failures <= 0:
            return
        streak = self._streak[engine_id] = self._streak.get(engine_id, 0) + 1
        if streak >= params.consecutive_failures:
            self.eject(engine_id, f"{streak} failed requests in a row")

    def eject(self, engine_id: str, why: str) -> None:
        """Take the engine out of rotation for its ejection time, within the pool's share."""
        params = self.params
        record = self.fleet.records.get(engine_id)
        if params.consecutive_failures <= 0 or record is None or record.tripped or not record.healthy:
            return  # (an unhealthy one is the monitor's: it re-admits it when it answers again)
        decode = record.adapter.role is Role.DECODE
        pool = [
            other
            for other in self.fleet.engines_of.get(record.model, ())
            if (other.adapter.role is Role.DECODE) == decode and other.healthy and not other.draining
        ]
        out = sum(1 for other in pool if (other.stalled or other.tripped) and other is not record)
        if not may_eject(params, out, len(pool)):
            return  # (it keeps failing requests: a retry takes them elsewhere)
        self.fleet.set_tripped(engine_id, True)
        if not record.tripped:
            return  # (the last of its pool that could take its work: restored at once)
        ejections = self._ejections[engine_id] = self._ejections.get(engine_id, 0) + 1
        seconds = ejection_s(params, ejections)
        metrics.ENGINE_EJECTIONS.labels(engine_id).inc()
        metrics.ENGINE_EJECTED.labels(engine_id).set(1.0)
        log.warning(
            "engine %s out of rotation for %.1f s: %s", engine_id, seconds, why, extra={"engine": engine_id}
        )
        timer = self._timers.pop(engine_id, None)
        if timer is not None:
            timer.cancel()
        self._timers[engine_id] = asyncio.get_running_loop().call_later(seconds, self._readmit, engine_id)

    def _readmit(self, engine_id: str) -> None:
        self._timers.pop(engine_id, None)
        metrics.ENGINE_EJECTED.labels(engine_id).set(0.0)
        record = self.fleet.records.get(engine_id)
        if record is None or not record.tripped:
            return  # (back already: its pool needed it, and it has been judged since)
        # on probation: the next failure takes it out again (for longer), a success clears it
        self._streak[engine_id] = max(0, self.params.consecutive_failures - 1)
        self.fleet.set_tripped(engine_id, False)
        log.info("engine %s back in rotation after its ejection", engine_id, extra={"engine": engine_id})

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
