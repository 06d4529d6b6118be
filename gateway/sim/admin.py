"""Lifecycle and operator routes of the simulated engine: sleep/wake (vLLM dev-mode API), weight
loading, fault injection, the P/D KV side channel and prefix-cache reset.

Registered by :class:`gateway.sim.server.SimServer` on its aiohttp app. Times are modelled:
a weight load sleeps ``profile.weights.load_time_s(source) / time_scale`` real seconds.

* ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` -> ``{"status":"sleeping","level":N}``.
  Level 0 pauses scheduling; 1 also "offloads weights" and discards the KV cache; 2 discards
  everything (weights reload from disk on wake). ``abort`` ends in-flight requests with
  finish_reason "abort"; ``wait`` stops admitting and waits for running requests to finish;
  ``keep`` keeps them queued (at level >= 1 they are recomputed after wake).
* ``POST /wake_up[?tags=weights&tags=kv_cache&tags=scheduling]`` -> ``{"status":"awake"|"sleeping",
  "tags":[...]}``; waking ``weights`` from level 1 costs the CPU-offload load time, from level 2
  the disk load time. ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``.
* ``POST /sim/load_weights {"source":"disk"|"cpu"|"peer","peer_url"?}`` pauses the engine for the
  profile's load time and answers ``{"status":"loaded","source":..,"seconds":..}``.
* ``POST /sim/role {"role":"collocated"|"prefill"|"decode"}``: the role bootstrap-room requests
  are served as (the gateway's admin role flip calls it).
* ``POST /sim/fault {"mode":"crash"|"hang"|"slow","factor":F}`` or ``{"clear":true}``.
* ``POST /sim/kv/pull {"request_id":..}`` or ``{"room":..,"wait_s":..}``: a decode engine takes the
  KV a prefill left here (the blocks are freed) and learns how many tokens it covers.
* ``POST /reset_prefix_cache`` -> ``{"success": bool}`` (false while a request is running).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

if TYPE_CHECKING:
    from gateway.sim.server import SimServer

ALL_TAGS = ("weights", "kv_cache", "scheduling")
SLEEP_STATES = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}
#: the longest a sleep with mode=wait waits for running requests to finish (engine seconds)
SLEEP_WAIT_S = 600.0


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _bad(message: str, param: str | None = None, status: int = 400) -> web.Response:
    from gateway.sim.responses import error_body

    return web.Response(
        status=status, body=error_body(status, message, param), content_type="application/json"
    )


async def _body(http: web.Request) -> dict[str, Any]:
    from gateway.sim.responses import error_body

    raw = await http.read()
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        data = exc
    if not isinstance(data, dict):
        message = f"invalid JSON: {data}" if isinstance(data, Exception) else "body must be a JSON object"
        text = error_body(400, message, None).decode()
        raise web.HTTPBadRequest(text=text, content_type="application/json")
    return data


Handler = Callable[["AdminRoutes", web.Request], Awaitable[web.Response]]


def _one_at_a_time(handler: Handler) -> Handler:
    """Sleep, wake-up and weight loads run one after another: each sets what the engine's pause
    and sleep state are when it ends, and interleaved, a wake-up ending its weight load unpaused
    an engine put to sleep meanwhile (or in the middle of another load)."""

    @functools.wraps(handler)
    async def serialised(self: AdminRoutes, http: web.Request) -> web.Response:
        async with self._lifecycle:
            return await handler(self, http)

    return serialised


class AdminRoutes:
    """Handlers bound to one :class:`SimServer`; state lives on the server."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.asleep: set[str] = set()
        self.level = 0
        self._lifecycle = asyncio.Lock()

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/sleep", self.sleep)
        r.add_post("/wake_up", self.wake_up)
        r.add_get("/is_sleeping", self.is_sleeping)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/sim/load_weights", self.load_weights)
        r.add_post("/sim/fault", self.fault)
        r.add_post("/sim/kv/pull", self.kv_pull)
        r.add_post("/sim/role", self.role)

    @property
    def sleep_state(self) -> str:
        return SLEEP_STATES[self.level] if self.asleep else "awake"

    @_one_at_a_time
    async def sleep(self, http: web.Request) -> web.Response:
        s = self.server
        try:
            level = int(http.query.get("level", "1"))
        except ValueError:
            level = -1
        if level not in SLEEP_STATES:
            return _bad("level must be 0, 1 or 2", "level")
        mode = http.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return _bad("mode must be abort, wait or keep", "mode")
        if mode == "wait":
            busy = s.model.running or s.model.transferring
            if busy and s.model.paused:
                # (a paused engine's requests never finish: the call waited for good, and no new
                # request was admitted meanwhile)
                return _bad("the engine is paused: its requests cannot finish; wake it first", "mode", 409)
            s.model.admitting = False
            deadline = asyncio.get_running_loop().time() + SLEEP_WAIT_S / s.scale
            try:
                while s.model.running or s.model.transferring:
                    if asyncio.get_running_loop().time() > deadline or s.model.paused:
                        return _bad(f"requests still run after {SLEEP_WAIT_S:g} s; not asleep", "mode", 409)
                    await asyncio.sleep(0.005)
            finally:
                s.model.admitting = True
        s.model.paused = True
        if mode == "abort":
            s.end_requests(s.model.reset(), crashed=False)
        elif level >= 1:
            s.model.preempt_all()  # their KV is discarded: they recompute after wake
        if level >= 1:
            s.model.cache.clear()
            s.publish_kv_events()
        self.level = max(self.level, level) if self.asleep else level
        # (added to what already sleeps: a level-0 sleep after a level-1 one leaves the weights off
        # the GPU, and the wake must still load them)
        self.asleep |= {"scheduling"} if level == 0 else set(ALL_TAGS)
        return _json({"status": "sleeping", "level": level})

    @_one_at_a_time
    async def wake_up(self, http: web.Request) -> web.Response:
        s = self.server
        tags = http.query.getall("tags", []) or list(ALL_TAGS)
        unknown = [t for t in tags if t not in ALL_TAGS]
        if unknown:
            return _bad(f"unknown tags {unknown}; use {list(ALL_TAGS)}", "tags")
        if "weights" in tags and "weights" in self.asleep:
            source = "cpu" if self.level == 1 else "disk"
            await asyncio.sleep(s.profile.weights.load_time_s(source) / s.scale)
        self.asleep.difference_update(tags)
        if not self.asleep:
            self.level = 0
            s.model.paused = False
            s.wake_driver()
        return _json({"status": "sleeping" if self.asleep else "awake", "tags": tags})

    async def role(self, http: web.Request) -> web.Response:
        """``{"role": "collocated"|"prefill"|"decode"}``: what bootstrap-room requests mean here
        (a gateway's role flip; NIXL-style requests carry their side in kv_transfer_params)."""
        try:
            body = await http.json()
        except ValueError:
            body = None
        role = body.get("role") if isinstance(body, dict) else None
        if role not in ("collocated", "prefill", "decode"):
            return _bad("role must be collocated, prefill or decode", "role")
        s = self.server
        s.config = dataclasses.replace(s.config, role=role)
        return _json({"role": role})

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return _json({"is_sleeping": bool(self.asleep)})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        s = self.server
        if s.model.running:
            return _json({"success": False})
        s.model.cache.clear()
        s.publish_kv_events()
        return _json({"success": True})

    @_one_at_a_time
    async def load_weights(self, http: web.Request) -> web.Response:
        s = self.server
        body = await _body(http)
        source = body.get("source", "disk")
        if source not in ("disk", "cpu", "peer"):
            return _bad("source must be disk, cpu or peer", "source")
        if source == "peer" and not body.get("peer_url"):
            return _bad("peer loading needs 'peer_url' (a running engine with the weights)", "peer_url")
        seconds = s.profile.weights.load_time_s(source)
        s.model.paused = True
        try:
            await asyncio.sleep(seconds / s.scale)
        finally:
            s.model.paused = bool(self.asleep)
            s.wake_driver()
        return _json({"status": "loaded", "source": source, "seconds": seconds})

    async def fault(self, http: web.Request) -> web.Response:
        s = self.server
        body = await _body(http)
        mode = body.get("mode")
        if body.get("clear"):
            s.crashed = s.hung = False
            s.model.slow_factor = 1.0 / s.config.speed
            s.wake_driver()
        elif mode == "crash":
            s.crash()
        elif mode == "hang":
            s.hung = True
        elif mode == "slow":
            try:
                factor = float(body.get("factor", 2.0))
            except (TypeError, ValueError):
                factor = 0.0
            if not 0 < factor < math.inf:  # (an infinite one slept the driver for good)
                return _bad("factor must be a finite number > 0", "factor")
            s.model.slow_factor = factor / s.config.speed  # (slower than the engine's own speed)
        else:
            return _bad("mode must be crash, hang or slow (or clear: true)", "mode")
        return _json({"crashed": s.crashed, "hung": s.hung, "slow_factor": s.model.slow_factor})

    async def kv_pull(self, http: web.Request) -> web.Response:
        s = self.server
        body = await _body(http)
        rid, room = body.get("request_id"), body.get("room")
        if rid is not None and not isinstance(rid, str):
            return _bad("request_id must be a string", "request_id")
        if room is not None and (isinstance(room, bool) or not isinstance(room, int | str)):
            return _bad("room must be an integer (or its digits)", "room")
        key = rid if rid else f"room:{room}"
        wait_s = body.get("wait_s", 0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s < math.inf:
            return _bad("wait_s must be a number of seconds >= 0", "wait_s")
        if key.startswith("room:") and key not in s.model.held:
            event = s.rooms.setdefault(key, asyncio.Event())
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), float(wait_s))
            finally:  # (a puller that left: the room's event must not stay for good)
                s.rooms.pop(key, None)
        held = s.model.release_held(key)
        if held is None:
            return _bad(
                f"no KV held for {key!r} (never prefilled here, already read, or lease expired)", status=404
            )
        s.publish_kv_events()
        return _json({"tokens": len(held.prompt), "bytes": len(held.prompt) * s.profile.kv_bytes_per_token})
