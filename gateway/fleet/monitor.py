"""The fleet monitor: health checks and metric scrapes for every engine on an interval.

Health and metrics are separate questions with separate loops. Only a failed health check counts
towards ejection (the data path ejects on its own connection failures); enough consecutive
successes re-admit the engine. What a read does show, an engine that answers its health route but
serves nothing (its model list lacks its model, or it sleeps while others serve the model), takes
it out at once, and its health checks count as failed while that holds. A scrape that fails or
times out only leaves the engine's scraped
state where it was: it goes stale after ``stale_after_s`` and routing falls back on the gateway's
own shadow of in-flight work (``policies.api.estimated_load``). A busy engine answers ``/metrics``
slowly (a real vLLM took 2.3 s under load), and ejecting it then would take the busiest engine
out exactly when it is most needed.

Each engine gets its own two tasks, so a slow engine never delays the others, and a hanging
scrape never delays a health check.

The scrape task also reads the engine's model list (``/v1/models``) beside its metrics, for the
LoRA adapters it has loaded (:meth:`Fleet.set_adapters`) and whether it lists its model: on the
scrape's cadence, never per request. A failed read, like a failed scrape, only leaves what the list
said as it was last read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from gateway import metrics
from gateway.engines.base import ModelList
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.tasks import cancel_and_wait

_T = TypeVar("_T")

log = logging.getLogger("slogate.fleet")

#: what a scrape may raise on an engine's answer (its text is untrusted: OverflowError for a
#: number past what a float or an int conversion takes)
_SCRAPE_ERRORS = (aiohttp.ClientError, TimeoutError, OSError, ValueError, OverflowError)


def describe_failure(exc: BaseException) -> str:
    """A one-line reason for a failed call, fit for logs and ``/admin/engines``.

    Never ``repr``: an aiohttp ``ClientResponseError``'s repr carries the request's headers,
    which include the engine's API key.
    """
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"HTTP {exc.status} {exc.message}".strip()
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class FleetMonitor:
    def __init__(
        self,
        fleet: Fleet,
        interval_s: float,
        eject_after_failures: int,
        readmit_after_successes: int,
        scrape_timeout_s: float | None = None,
        stall_after_s: float = 0.0,
    ) -> None:
        self.fleet = fleet
        #: see Settings.stall_after_s (0: off)
        self.stall_after_s = stall_after_s
        self.interval_s = interval_s
        self.eject_after = eject_after_failures
        self.readmit_after = readmit_after_successes
        #: hard bound on one whole scrape (an adapter may make several requests for one reading)
        self.scrape_timeout_s = scrape_timeout_s
        #: why the latest scrape of an engine failed; absent after a successful one
        self.scrape_errors: dict[str, str] = {}
        #: why the latest read of an engine's model list (its LoRA adapters) failed; likewise
        self.adapter_errors: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.first_round = asyncio.Event()
        # the first round is one health check and one scrape attempt per engine
        self._pending_first = 2 * len(fleet.records)
        if not self._pending_first:
            self.first_round.set()

    def start(self) -> None:
        for record in self.fleet.records.values():
            name = record.engine_id
            self._tasks.append(
                asyncio.create_task(self._loop(record, self.check_health), name=f"health:{name}")
            )
            self._tasks.append(
                asyncio.create_task(self._loop(record, self.scrape_round), name=f"scrape:{name}")
            )

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()

    async def check_once(self, record: EngineRecord) -> None:
        """One health check and one scrape round, side by side. Never raises."""
        await asyncio.gather(self.check_health(record), self.scrape_round(record))

    async def scrape_round(self, record: EngineRecord) -> bool:
        """One metrics scrape and one read of the LoRA adapters, side by side; returns the
        scrape's result. Never raises; a failure never touches health."""
        scraped, _ = await asyncio.gather(self.scrape_once(record), self.read_adapters(record))
        return scraped

    async def check_health(self, record: EngineRecord) -> bool:
        """One health check; its result alone decides ejection and re-admission. Never raises."""
        engine_id = record.engine_id
        sent = time.monotonic()
        ok = await record.adapter.health()
        if ok is None:  # the gateway had no socket for the check: no verdict on the engine
            log.debug("health check of %s not made: no socket", engine_id, extra={"engine": engine_id})
            self._check_stall(record)  # (what it holds decides that, not the check)
            return False
        if ok:  # (a refused or timed-out check is no measure of the path)
            self.fleet.record_round_trip(engine_id, time.monotonic() - sent)
        error = "" if ok else "health check failed"
        if ok and (why := self._not_serving(record)):
            ok, error = False, why  # (answering its health route, it still serves none of it)
        if ok and not record.healthy and (why := await self._role_told(record)):
            ok, error = False, why
        flipped = self.fleet.record_health(engine_id, ok, self.eject_after, self.readmit_after, error)
        if flipped:
            level = logging.INFO if record.healthy else logging.WARNING
            log.log(
                level,
                "engine %s is now %s",
                engine_id,
                "healthy" if record.healthy else "ejected",
                extra={"engine": engine_id, "reason": error},
            )
        self._check_stall(record)
        # in rotation: healthy and not draining (for a role flip or a scale-in), stalled nor ejected
        in_rotation = record.healthy and not record.draining and not record.stalled and not record.tripped
        metrics.ENGINE_HEALTHY.labels(engine_id).set(1.0 if in_rotation else 0.0)
        if not record.healthy:
            # what it last reported no longer holds: no series rather than a dead engine's last
            # load (dashboards summed it, KV alerts kept firing). On every failed check, not only
            # on the flip: the data path may have ejected it first. A scrape sets them again only
            # once it is healthy (vLLM serves /metrics after its engine core died)
            for gauge in (metrics.ENGINE_RUNNING, metrics.ENGINE_WAITING, metrics.ENGINE_KV_USAGE):
                with contextlib.suppress(KeyError):
                    gauge.remove(engine_id)
        metrics.ENGINE_IN_FLIGHT.labels(engine_id).set(record.in_flight)
        return ok

    async def _role_told(self, record: EngineRecord) -> str:
        """Before an ejected engine is re-admitted: one flipped away from its launch role is told
        its role again (a restart put it back in the launch one: a simulated engine flipped to
        prefill came back a decode engine, and every P/D request sent there waited out its KV
        handover and failed). "" when done or not needed, else why not."""
        adapter = record.adapter
        if adapter.role is adapter.config.role or record.role_target is not None or record.role_unsure:
            return ""  # (a flip under way, or one that failed, tells it itself)
        try:
            await adapter.switch_role(adapter.role)
        except Exception as exc:
            return f"its role ({adapter.role.value}) could not be set again: {describe_failure(exc)}"
        return ""

    def _check_stall(self, record: EngineRecord) -> None:
        """Out of rotation while it holds work and shows no progress, back when it does."""
        engine_id = record.engine_id
        flipped = self.fleet.check_stall(engine_id, time.monotonic(), self.stall_after_s)
        # (set on every check: an engine also returns without a check of its own, when the others
        # of its model leave rotation)
        metrics.ENGINE_STALLED.labels(engine_id).set(1.0 if record.stalled else 0.0)
        if not flipped:
            return
        if record.stalled:
            metrics.ENGINE_STALLS.labels(engine_id).inc()
            log.warning(
                "engine %s is stalled: it holds %d requests and has shown no progress for %.0f s; "
                "out of rotation until it does",
                engine_id,
                record.in_flight,
                self.stall_after_s,
                extra={"engine": engine_id},
            )
        else:
            log.info("engine %s is back in rotation after a stall", engine_id, extra={"engine": engine_id})

    async def scrape_once(self, record: EngineRecord) -> bool:
        """One metrics scrape. Never raises; a failed one never touches health (one that shows
        the engine asleep while others serve its model takes it out: see :meth:`_not_serving`).

        On failure the last good state and its timestamp stay as they were, so the snapshot marks
        the engine stale once that reading is older than ``stale_after_s``.
        """
        engine_id = record.engine_id
        if record.adapter.metrics_path is None:
            return False  # nothing to scrape: the state stays None, which policies treat as stale
        sent_at, at_send = time.monotonic(), (record.in_flight, record.in_flight_tokens)
        remote_at_send = (record.remote_in_flight, record.remote_tokens)
        ok, state = await self._read(
            engine_id, record.adapter.scrape, self.scrape_errors, "metrics scrape", "its state will go stale"
        )
        if not ok:
            self.fleet.scrape_failed(engine_id, time.monotonic())
            return False
        self.fleet.record_state(engine_id, state, time.monotonic(), sent_at, at_send, remote_at_send)
        if self.scrape_errors.pop(engine_id, None) is not None:
            log.info("metrics scrape of %s recovered", engine_id, extra={"engine": engine_id})
        self._out_if_not_serving(record)
        # (what the fleet kept: bounded, where the engine's own report may say -5 running or a
        # KV use of 7, which dashboards and alerts then showed)
        kept = record.state
        if state is not None and kept is not None and record.healthy:
            metrics.ENGINE_WAITING.labels(engine_id).set(kept.num_waiting)
            metrics.ENGINE_RUNNING.labels(engine_id).set(kept.num_running)
            metrics.ENGINE_KV_USAGE.labels(engine_id).set(kept.kv_usage)
        return True

    async def read_adapters(self, record: EngineRecord) -> bool:
        """One read of the engine's model list for the LoRA adapters it has loaded. Never raises,
        a failed read never touches health: the adapters stay as last read (one that shows the
        model missing takes the engine out: see :meth:`_not_serving`). An engine that publishes
        no model list has none."""
        engine_id = record.engine_id
        if record.adapter.models_path is None:
            return False
        adapter = record.adapter

        async def fetch() -> ModelList | int | None:
            try:
                return await adapter.read_model_list()
            except aiohttp.ClientResponseError as exc:
                if exc.status in (401, 403):
                    return exc.status  # (it answers, and refuses the gateway: see below)
                raise

        ok, listed = await self._read(
            engine_id,
            fetch,
            self.adapter_errors,
            "reading the model list",
            "its LoRA adapters stay as last read",
        )
        if not ok:
            return False
        self.adapter_errors.pop(engine_id, None)
        unlisted = ""
        if isinstance(listed, int):
            # its health route needs no key, its API does: every request placed there came back
            # refused, at once, so it looked the least loaded engine and drew the most
            unlisted = (
                f"it refuses the gateway's credentials (HTTP {listed} on its model list): check the "
                "api_key configured for it"
            )
            listed = ModelList(record.adapters, None, (), record.max_model_len)
        adapters = frozenset() if listed is None else listed.adapters
        record.max_model_len = None if listed is None else listed.max_model_len
        if listed is not None and listed.serves_model is False:
            names = ", ".join(repr(name[:80]) for name in listed.names[:5]) or "none"
            more = f" and {len(listed.names) - 5} more" if len(listed.names) > 5 else ""
            unlisted = f"its model list does not name model {record.model!r} (it lists {names}{more})"
        if unlisted != record.unlisted:
            record.unlisted = unlisted
            if not unlisted:
                log.info(
                    "engine %s lists model %r again", engine_id, record.model, extra={"engine": engine_id}
                )
        self._out_if_not_serving(record)
        before = record.adapters
        if self.fleet.set_adapters(engine_id, adapters):
            log.info(
                "engine %s has LoRA adapters %s (was %s)",
                engine_id,
                sorted(record.adapters) or "none",
                sorted(before) or "none",
                extra={"engine": engine_id},
            )
        return True

    def _not_serving(self, record: EngineRecord) -> str:
        """Why an engine that answers its health route serves none of its model's requests all
        the same ("" when it may): its model list lacks the model (an address another deployment
        took over: each request got its 404, and failing at once it looked the least loaded),
        or its fresh metrics say it sleeps while other engines serve its model (it holds work
        until woken, and with its load and KV cache at nothing it drew every request; the last
        one in rotation stays: holding requests until woken beats refusing every one)."""
        if record.unlisted:
            return record.unlisted
        state = record.state
        if (
            state is not None
            and state.sleeping
            and time.monotonic() - record.state_at <= self.fleet.stale_after_s
            and self.fleet.peers(record)
        ):
            return "it is asleep (its metrics report a sleep state) and other engines serve its model"
        return ""

    def _out_if_not_serving(self, record: EngineRecord) -> None:
        """Out of rotation at once when it cannot serve (its health checks keep it out until it can)."""
        why = self._not_serving(record)
        if why and record.healthy:
            self.fleet.eject(record.engine_id, why)
            log.warning(
                "engine %s is out of rotation: %s", record.engine_id, why, extra={"engine": record.engine_id}
            )

    async def _read(
        self, engine_id: str, fetch: Callable[[], Awaitable[_T]], errors: dict[str, str], what: str, so: str
    ) -> tuple[bool, _T | None]:
        """``fetch()`` under the scrape timeout: (True, its result), or (False, None) with the
        reason in ``errors`` and a warning once per run of failures (every further one is routine
        until a success)."""
        try:
            async with asyncio.timeout(self.scrape_timeout_s):
                return True, await fetch()
        except _SCRAPE_ERRORS as exc:
            reason = describe_failure(exc)
            level = logging.DEBUG if engine_id in errors else logging.WARNING
            errors[engine_id] = reason
            log.log(
                level, "%s of %s failed; %s: %s", what, engine_id, so, reason, extra={"engine": engine_id}
            )
            return False, None

    async def _loop(self, record: EngineRecord, check: Callable[[EngineRecord], Awaitable[bool]]) -> None:
        first = True
        while True:
            started = time.monotonic()
            try:
                await check(record)
            except Exception:  # a bug here must not silently stop monitoring this engine
                log.exception("monitor tick failed for %s", record.engine_id)
            if first:
                first = False
                self._pending_first -= 1
                if self._pending_first <= 0:
                    self.first_round.set()
            self.fleet.touch(record.engine_id)  # re-evaluate its staleness at least once per interval
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
