"""Role flips: what may flip when (gateway.fleet.roles.check_flip)."""

from __future__ import annotations

import pytest

from gateway.api.errors import GatewayError
from gateway.dispatch.offline import fleet_of
from gateway.fleet.roles import check_flip
from gateway.settings import EngineConfig
from policies.api import Role
from tests.support.local_app import serving


def _fleet(*roles: str):  # type: ignore[no-untyped-def]
    configs = [
        EngineConfig(url=f"http://127.0.0.1:{10_000 + i}", kind="sim", model="m", name=f"e{i}", role=role)  # type: ignore[arg-type]
        for i, role in enumerate(roles)
    ]
    return fleet_of(configs, 3.0)


def test_the_only_front_engine_flips_only_when_the_gap_is_accepted() -> None:
    """Flipping a model's only collocated/prefill engine took it out of rotation for the whole
    drain: every new request of the model was a 503, up to the drain timeout."""
    fleet = _fleet("collocated", "decode")
    with pytest.raises(GatewayError) as info:
        check_flip(fleet, "e0", Role.PREFILL)
    assert info.value.status == 409 and "allow_gap" in info.value.message
    assert info.value.payload()["error"]["type"] == "invalid_request_error"  # type: ignore[index]  # (not a server error)
    check_flip(fleet, "e0", Role.PREFILL, allow_gap=True)
    # another front engine in rotation takes the requests meanwhile
    check_flip(_fleet("collocated", "collocated"), "e0", Role.DECODE)
    # a decode engine's drain leaves the front alone
    check_flip(_fleet("prefill", "decode", "decode"), "e1", Role.PREFILL)


def test_a_flip_that_strands_the_model_is_refused_even_with_the_gap_accepted() -> None:
    with pytest.raises(GatewayError):
        check_flip(_fleet("collocated"), "e0", Role.DECODE, allow_gap=True)
    with pytest.raises(GatewayError):  # prefill engines and no decode engine after it
        check_flip(_fleet("prefill", "prefill", "decode"), "e2", Role.PREFILL, allow_gap=True)


async def test_a_failed_role_change_tells_the_engine_its_old_role_again() -> None:
    """The engine may take a role and fail to say so in time: the gateway kept the old role
    while the engine ran the new one (prefill requests sent to a decode engine)."""
    from gateway.fleet.roles import flip_role

    fleet = _fleet("collocated", "collocated")
    record = fleet.records["e1"]
    told: list[Role] = []

    async def switch_role(role: Role) -> None:
        told.append(role)
        if len(told) == 1:
            raise TimeoutError()

    record.adapter.switch_role = switch_role  # type: ignore[method-assign]
    with pytest.raises(GatewayError) as info:
        await flip_role(fleet, "e1", Role.DECODE, 1.0)
    assert info.value.status == 502
    assert told == [Role.DECODE, Role.COLLOCATED] and record.adapter.role is Role.COLLOCATED
    assert not record.draining


async def test_an_engine_whose_role_is_unknown_stays_out_of_rotation_until_a_flip_mends_it() -> None:
    """The change failed and so did the restore: the engine may run either role. It went back
    into rotation under the old one, and asking for the old role again was a no-op that never
    told the engine (200, drained_s 0), so nothing could bring the two back into agreement."""
    from gateway.fleet.roles import flip_role

    fleet = _fleet("collocated", "collocated")
    record = fleet.records["e1"]
    told: list[Role] = []

    async def switch_role(role: Role) -> None:
        told.append(role)
        if len(told) <= 2:
            raise TimeoutError()

    record.adapter.switch_role = switch_role  # type: ignore[method-assign]
    with pytest.raises(GatewayError) as info:
        await flip_role(fleet, "e1", Role.DECODE, 1.0)
    assert info.value.status == 502 and told == [Role.DECODE, Role.COLLOCATED]
    assert record.role_unsure and record.draining and not fleet.in_front(record)
    flip = await flip_role(fleet, "e1", Role.COLLOCATED, 1.0)  # the role it is recorded in
    assert told[-1] is Role.COLLOCATED and flip.role is Role.COLLOCATED
    assert not record.role_unsure and not record.draining and fleet.in_front(record)


async def test_a_flip_cancelled_while_restoring_the_old_role_leaves_the_role_unknown() -> None:
    """Cancelled (a shutdown's backstop) while the engine was being told its old role again after
    a failed change: the engine went back into rotation under the old role, whichever it ran."""
    import asyncio

    from gateway.fleet.roles import flip_role

    fleet = _fleet("collocated", "collocated")
    record = fleet.records["e1"]
    told: list[Role] = []
    restoring = asyncio.Event()

    async def switch_role(role: Role) -> None:
        told.append(role)
        if len(told) == 1:
            raise TimeoutError()
        restoring.set()
        await asyncio.sleep(60)

    record.adapter.switch_role = switch_role  # type: ignore[method-assign]
    flip = asyncio.create_task(flip_role(fleet, "e1", Role.DECODE, 1.0))
    await asyncio.wait_for(restoring.wait(), 5)
    flip.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flip
    assert record.role_unsure and record.draining and not fleet.in_front(record)
    # the model's other engine is in rotation; were it not, the mend needs no allow_gap: the
    # unsure engine is out already
    fleet.set_draining("e0", True)
    record.adapter.switch_role = lambda role: asyncio.sleep(0)  # type: ignore[method-assign,assignment,return-value]
    await flip_role(fleet, "e1", Role.COLLOCATED, 1.0)
    assert not record.role_unsure and fleet.in_front(record)


async def test_a_refused_role_change_never_shows_the_engine_s_key(caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's ClientResponseError carries the request's headers in its repr: the 502 and the
    log of a refused role change showed the engine's Authorization header."""
    import aiohttp
    from aiohttp import web

    from gateway.engines import adapter_for
    from gateway.fleet.registry import Fleet
    from gateway.fleet.roles import flip_role

    async def refuse(_: web.Request) -> web.Response:
        return web.Response(status=500, text="no")

    app = web.Application()
    app.router.add_post("/sim/role", refuse)
    async with serving(app) as port, aiohttp.ClientSession() as session:
        adapters = [
            adapter_for(
                EngineConfig(
                    url=f"http://127.0.0.1:{port}",
                    kind="sim",
                    model="m",
                    name=f"e{i}",
                    api_key="sk-ENGINE-SECRET",
                ),  # type: ignore[arg-type]
                session,
                2.0,
            )
            for i in range(2)
        ]
        fleet = Fleet(adapters, 3.0)
        for name in fleet.records:
            fleet.record_health(name, True, 1, 1)
        with pytest.raises(GatewayError) as info:
            await flip_role(fleet, "e1", Role.DECODE, 1.0)
    assert info.value.status == 502 and "HTTP 500" in info.value.message
    assert "SECRET" not in info.value.message and "SECRET" not in caplog.text
    assert "could not be restored" in caplog.text  # (the restore was refused as well, and logged)


async def test_a_flip_waiting_on_its_engine_counts_for_the_checks_of_another_one() -> None:
    """A flip to prefill waiting for its engine's answer still recorded its engine as collocated:
    a second flip took the model's only decode engine away meanwhile, both succeeded, and the
    model was left with a prefill engine and nothing to decode (every P/D request failed)."""
    import asyncio

    from gateway.fleet.roles import flip_role

    fleet = _fleet("collocated", "collocated", "decode")
    answer = asyncio.Event()

    async def slow_switch(role: Role) -> None:
        await answer.wait()

    async def switch(role: Role) -> None:
        return None

    fleet.records["e0"].adapter.switch_role = slow_switch  # type: ignore[method-assign]
    fleet.records["e2"].adapter.switch_role = switch  # type: ignore[method-assign]
    first = asyncio.create_task(flip_role(fleet, "e0", Role.PREFILL, 1.0))
    for _ in range(5):
        await asyncio.sleep(0)
    assert fleet.records["e0"].draining and not first.done()
    with pytest.raises(GatewayError) as info:
        await flip_role(fleet, "e2", Role.COLLOCATED, 1.0)
    assert info.value.status == 409 and "no decode engine" in info.value.message
    answer.set()
    assert (await first).role is Role.PREFILL
    assert fleet.records["e2"].adapter.role is Role.DECODE and not fleet.records["e2"].draining
    assert fleet.records["e0"].role_target is None
    # with the flip over, its engine's role counts as any other's: e2 is still the only decoder
    with pytest.raises(GatewayError):
        await flip_role(fleet, "e2", Role.COLLOCATED, 1.0)


async def test_a_role_change_that_never_reached_the_engine_leaves_it_in_rotation() -> None:
    """Nothing listens at the engine's address: the change was never sent, so the engine has
    its old role. Marked unsure (as when an answer is lost), it stayed out of rotation after it
    came back, until someone flipped it again by hand."""
    import socket

    import aiohttp

    from gateway.fleet.roles import flip_role

    fleet = _fleet("collocated", "collocated")
    record = fleet.records["e1"]
    # a port held bound and not listening: refused, and no other process can take it meanwhile
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        async with aiohttp.ClientSession() as session:
            record.adapter.session = session
            record.adapter.base_url = f"http://127.0.0.1:{held.getsockname()[1]}"
            with pytest.raises(GatewayError) as info:
                await flip_role(fleet, "e1", Role.DECODE, 1.0)
    assert info.value.status == 502
    assert not record.role_unsure and not record.draining and record.role_target is None
    assert record.adapter.role is Role.COLLOCATED and fleet.in_front(record)


def test_the_only_engine_with_a_lora_adapter_flips_only_when_the_gap_is_accepted() -> None:
    """While it drains, and after it as a decode engine, that adapter's requests are refused
    (the stall check already keeps such an engine in rotation)."""
    fleet = _fleet("collocated", "collocated", "decode")
    fleet.records["e0"].adapters = frozenset({"a1", "shared"})
    fleet.records["e1"].adapters = frozenset({"shared"})
    with pytest.raises(GatewayError) as info:
        check_flip(fleet, "e0", Role.DECODE)
    assert info.value.status == 409 and "'a1'" in info.value.message and "'shared'" not in info.value.message
    check_flip(fleet, "e0", Role.DECODE, allow_gap=True)
    check_flip(fleet, "e1", Role.DECODE)  # (its adapter is loaded on e0 too)
    fleet.records["e1"].adapters = frozenset({"a1", "shared"})
    check_flip(fleet, "e0", Role.PREFILL)


@pytest.mark.parametrize(
    ("settings", "allowed"),
    [
        ({}, False),  # a plain collocated vLLM engine: nothing says it runs a KV connector
        ({"kv_transfer": "nixl"}, True),  # declared: its kv_transfer_params say which side it is
        ({"role": "decode"}, True),  # configured in a P/D role: it runs one
    ],
)
async def test_a_vllm_engine_flips_only_when_it_is_known_to_run_a_kv_connector(
    settings: dict[str, str], allowed: bool
) -> None:
    """A plain collocated vLLM engine was flipped to prefill with a 200 and nothing told: every
    prefill it then served came back without kv_transfer_params (a 502 each)."""
    from gateway.fleet.roles import flip_role

    role = settings.get("role", "collocated")
    others = [
        EngineConfig(url="http://127.0.0.1:10001", kind="vllm", model="m", name="c1"),  # type: ignore[arg-type]
        EngineConfig(url="http://127.0.0.1:10002", kind="vllm", model="m", name="d1", role="decode"),  # type: ignore[arg-type]
        EngineConfig(url="http://127.0.0.1:10003", kind="vllm", model="m", name="p1", role="prefill"),  # type: ignore[arg-type]
    ]
    fleet = fleet_of(
        [EngineConfig(url="http://127.0.0.1:10000", kind="vllm", model="m", name="e0", **settings), *others],  # type: ignore[arg-type]
        3.0,
    )
    target = Role.PREFILL if role == "collocated" else Role.COLLOCATED
    if allowed:
        assert (await flip_role(fleet, "e0", target, 1.0)).role is target
    else:
        with pytest.raises(GatewayError) as info:
            await flip_role(fleet, "e0", target, 1.0)
        assert info.value.status == 409 and info.value.code == "role_fixed"
        assert "kv_transfer" in info.value.message and fleet.records["e0"].adapter.role.value == role


@pytest.mark.parametrize("out", ["stalled", "ejected"])
def test_an_engine_out_of_rotation_does_not_count_as_the_one_left(out: str) -> None:
    """An engine out for a stall or for failed requests takes nothing: counted as in rotation, a
    flip left the model only that engine (which its pool then took back as its last)."""

    def mark(fleet, engine_id: str) -> None:  # type: ignore[no-untyped-def]
        if out == "stalled":
            fleet.set_stalled(engine_id, True)
        else:
            fleet.set_tripped(engine_id, True)
        assert getattr(fleet.records[engine_id], "stalled" if out == "stalled" else "tripped")

    fleet = _fleet("collocated", "collocated")
    mark(fleet, "e1")
    with pytest.raises(GatewayError) as info:
        check_flip(fleet, "e0", Role.DECODE)
    assert info.value.status == 409
    fleet = _fleet("prefill", "decode", "decode")
    mark(fleet, "e2")
    with pytest.raises(GatewayError):  # (the other decode engine is out: none would be left)
        check_flip(fleet, "e1", Role.COLLOCATED, allow_gap=True)
    check_flip(_fleet("prefill", "decode", "decode"), "e1", Role.COLLOCATED, allow_gap=True)
