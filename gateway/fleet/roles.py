"""Role flips: an engine switches between collocated, prefill and decode without losing a request.

The flip drains first: the engine leaves rotation (no new placement in either stage), what runs
there finishes, the engine is told its new role through its adapter's hook, and it comes back
in its new pool. A flip that would leave a model with nobody to take its queue (no collocated or
prefill engine) or a disaggregated model with no decode engine is refused: the admin call says
which engine to add first. A drain that does not finish in time is undone, and the engine keeps
its role. Called by ``POST /admin/engines/{id}/role``; the autoscaler will call it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp

from gateway.api.errors import GatewayError
from gateway.fleet.monitor import describe_failure
from gateway.fleet.registry import FRONT_ROLES, EngineRecord, Fleet
from policies.api import Role

log = logging.getLogger("slogate.fleet.roles")


def not_sent(exc: BaseException) -> bool:
    """Whether a call failed before its request reached the engine (no connection made), so
    the engine cannot have acted on it."""
    return isinstance(exc, aiohttp.ClientConnectorError)


#: how often a drain looks whether the engine's last request has left
_DRAIN_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class RoleFlip:
    engine_id: str
    before: Role
    role: Role
    drained_s: float


def check_flip(fleet: Fleet, engine_id: str, role: Role, allow_gap: bool = False) -> None:
    """Raise a 409 GatewayError when flipping ``engine_id`` to ``role`` would strand its model:
    after the flip, or, unless ``allow_gap``, while it drains (out of rotation meanwhile, the
    model's only front engine left every new request a 503 for the whole drain)."""
    record = fleet.records[engine_id]
    model = record.model
    others = [r for r in fleet.engines_of[model] if r.engine_id != engine_id]
    # (an engine another flip is moving is draining, so serves in neither list; nor does one out
    # of rotation for a stall or failed requests: counted, a flip left the model only an engine
    # answering 500s, which the pool then took back as its last)
    during = [(r.adapter.role, _in_rotation(r)) for r in others]
    after = [*during, (role, record.healthy)]
    # ...but it may end up a prefill engine, which needs decode engines: a flip to prefill
    # waiting on its engine's answer let a second flip take the model's last decode engine away
    moving = [role for r in others if r.role_target is not None for role in (r.role_target, r.adapter.role)]
    if not any(r in FRONT_ROLES and up for r, up in after):
        raise GatewayError(
            409,
            f"engine {engine_id} is the last engine taking model {model!r}'s requests (collocated or "
            "prefill) in rotation: add or heal another one first",
            code="last_engine",
        )
    if (
        not allow_gap
        and record.adapter.role in FRONT_ROLES
        and not any(r in FRONT_ROLES and up for r, up in during)
    ):
        raise GatewayError(
            409,
            f"engine {engine_id} is model {model!r}'s only engine taking its requests in rotation: "
            "while it drains, every new request would be refused. Add one first, or accept the "
            'gap with "allow_gap": true',
            code="last_engine",
        )
    if not allow_gap and record.adapter.role in FRONT_ROLES and record.adapters:
        peers = [r for r in others if r.adapter.role in FRONT_ROLES and _in_rotation(r)]
        alone = sorted(name for name in record.adapters if not any(name in p.adapters for p in peers))
        if alone:
            # (as the stall check keeps such an engine: out of rotation, those requests are refused)
            named = ", ".join(repr(name) for name in alone[:5]) + (" and more" if len(alone) > 5 else "")
            raise GatewayError(
                409,
                f"engine {engine_id} is the only engine in rotation with the LoRA adapter(s) {named} "
                "loaded: while it drains, their requests would be refused. Load them on another "
                'engine first, or accept the gap with "allow_gap": true',
                code="last_engine",
            )
    if any(r is Role.PREFILL for r in (*(r for r, _ in after), *moving)) and not any(
        r is Role.DECODE and up for r, up in after
    ):
        raise GatewayError(
            409,
            f"model {model!r} has prefill engines but would have no decode engine in rotation: "
            "add or heal one first",
            code="last_engine",
        )


def _in_rotation(record: EngineRecord) -> bool:
    return record.healthy and not record.draining and not record.stalled and not record.tripped


async def flip_role(
    fleet: Fleet, engine_id: str, role: Role, drain_timeout_s: float, allow_gap: bool = False
) -> RoleFlip:
    """Drain ``engine_id``, switch it to ``role``, put it back (see the module docstring)."""
    record = fleet.records[engine_id]
    before = record.adapter.role
    # (an engine whose role is unsure was left draining by the failure: a flip is what mends it,
    # to either role, and it is told the role even when the gateway already records it)
    unsure = record.role_unsure
    if record.draining and not unsure:
        raise GatewayError(409, f"engine {engine_id} is already being drained", code="draining")
    if before is role and not unsure:
        return RoleFlip(engine_id, before, role, 0.0)
    why_not = record.adapter.can_switch_role()
    if why_not is not None:
        raise GatewayError(409, f"engine {engine_id} ({record.adapter.kind}): {why_not}", code="role_fixed")
    # (an unsure engine is out of rotation already: mending it opens no gap)
    check_flip(fleet, engine_id, role, allow_gap or unsure)
    started = time.monotonic()
    fleet.set_draining(engine_id, True)
    record.role_target = role
    # this flip owns the engine now (a second request meanwhile is refused as a drain under way);
    # whatever ends it before the engine confirms a role leaves an unsure one as it was
    record.role_unsure = False
    left_unsure = unsure
    try:
        while record.running:
            if time.monotonic() - started > drain_timeout_s:
                raise GatewayError(
                    409,
                    f"engine {engine_id} still runs {len(record.running)} requests after "
                    f"{drain_timeout_s:g} s; its role is unchanged",
                    code="drain_timeout",
                )
            await asyncio.sleep(_DRAIN_POLL_S)
        # again: other engines may have left during the drain (the gap is over by now)
        check_flip(fleet, engine_id, role, allow_gap=True)
        try:
            await record.adapter.switch_role(role)
        except asyncio.CancelledError:
            left_unsure = True  # (told or not, nobody will know: as when the restore fails)
            raise
        except Exception as exc:  # the engine did not take it: it keeps serving as before
            if not_sent(exc):
                # never reached the engine (refused, unreachable): its role is the one it had,
                # and it comes back in it; marked unsure, a short outage left it out for good
                raise GatewayError(
                    502, f"engine {engine_id} refused the role change: {describe_failure(exc)}"
                ) from None
            # it may have taken it and failed to say so (an answer past the timeout): told its
            # old role again, so that the engine and the gateway agree on it (best effort)
            left_unsure = True  # (until the engine confirms it: a cancellation here leaves it so)
            try:
                await record.adapter.switch_role(before)
                left_unsure = False
            except Exception as again:
                # it may run either role: out of rotation until a flip (to either) succeeds,
                # rather than sent requests its role may not serve
                log.error(
                    "engine %s: role change to %s failed and its role %s could not be restored: "
                    "%s; it stays out of rotation until a role change succeeds",
                    engine_id,
                    role.value,
                    before.value,
                    describe_failure(again),
                    extra={"engine": engine_id},
                )
            reason = describe_failure(exc)
            raise GatewayError(502, f"engine {engine_id} refused the role change: {reason}") from None
        fleet.set_role(engine_id, role)
        left_unsure = False
    finally:
        record.role_target = None
        record.role_unsure = left_unsure
        if not left_unsure:
            fleet.set_draining(engine_id, False)
    drained = time.monotonic() - started
    log.info("engine %s: role %s -> %s after %.3f s drain", engine_id, before.value, role.value, drained)
    return RoleFlip(engine_id, before, role, drained)
