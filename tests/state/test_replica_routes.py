"""Gateway replicas share where they sent requests: each one's dispatches feed the others' prefix
index and session map through the store, so a conversation's next turn, through another replica,
is routed to the engine holding its prompt."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import orjson
import pytest

from gateway import metrics
from gateway.dispatch.offline import offline_fleet
from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.router import Router, load_pipeline
from gateway.state import replica_routes
from gateway.state.replica_routes import (
    FORMAT,
    MAX_AHEAD_S,
    MAX_KEYS,
    MAX_MESSAGE_BYTES,
    MAX_MESSAGE_KEYS,
    MAX_ROUTES,
    STAMP_WINDOW_S,
    ReplicaRoutes,
    Route,
    decode,
    encode,
)
from gateway.state.store import MemoryStore, StoreError
from gateway.tokenizer import apply_chat_template
from gateway.tokenizer import encode as tokens_of
from policies.api import RequestView
from policies.plugins.affinity import MemoryAffinityStore, affinity_key

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "routing"
MODEL = "m"
SESSION = affinity_key("tenant", "conversation-7")
HISTORY = [{"role": "user", "content": "Plan a week of meals around lentils and rice. " * 10}]


def _replica(block_size: int = 16) -> tuple[Fleet, PrefixRouting, Router]:
    fleet = offline_fleet({MODEL: 2})
    index = PrefixIndex(1 << 24, 120.0)
    routing = PrefixRouting(fleet, index, MemoryAffinityStore(ttl_s=300.0))
    for engine_id in fleet.records:
        index.set_block_size(engine_id, block_size)
    return fleet, routing, Router(fleet, load_pipeline(PROFILES / "prefix-aware.yaml"), routing)


def _prompt(messages: list[dict[str, str]]) -> PromptBlocks:
    return PromptBlocks(tokens_of(apply_chat_template(messages)), root_key(MODEL))


def _turn(
    routing: PrefixRouting, router: Router, rid: str, messages: list[dict[str, str]], now: float
) -> str:
    routing.attach(rid, _prompt(messages), SESSION)
    chosen = router.choose(RequestView(rid, MODEL, 200, 20), now=now)
    assert chosen is not None
    return chosen.engine_id


async def until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.002)


def heard_on(store: MemoryStore, channel: str) -> tuple[list[bytes], asyncio.Task[None]]:
    """What is published on ``channel`` from now on, as a task collects it (:func:`cancelled` at
    the end)."""
    heard: list[bytes] = []

    async def listen() -> None:
        async for message in store.subscribe(channel):
            heard.append(message)

    return heard, asyncio.create_task(listen())


async def cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _pair(
    store: MemoryStore, peers: list[bool], clock: Callable[[], float] = lambda: 1.0
) -> tuple[tuple[Fleet, PrefixRouting, Router], ...]:
    """Replicas ``ra`` and ``rb`` sharing routes through ``store`` while ``peers[0]``; what one
    hears is written at ``clock()`` (the routers' own time is given per call)."""
    a, b = _replica(), _replica()
    routes_a = ReplicaRoutes(a[1], store, "ra", lambda: peers[0], push_delay_s=0.001, clock=clock)
    routes_b = ReplicaRoutes(b[1], store, "rb", lambda: peers[0], push_delay_s=0.001, clock=clock)
    routes_a.start()
    routes_b.start()
    return a, b


async def _stop(*routings: PrefixRouting) -> None:
    for routing in routings:
        listener = routing.route_listener
        owner = getattr(listener, "__self__", None)
        if isinstance(owner, ReplicaRoutes):
            await owner.stop()


def _taken() -> float:
    return metrics.REPLICA_ROUTES.labels("taken")._value.get()


async def test_the_next_turn_through_the_other_replica_goes_where_the_first_went() -> None:
    (_, ra, router_a), (fb, rb, router_b) = _pair(MemoryStore(), [True])
    try:
        await asyncio.sleep(0.01)  # (both subscribed)
        taken = _taken()
        first = _turn(ra, router_a, "t1", HISTORY, now=1.0)
        other = next(e for e in fb.records if e != first)
        assert SESSION is not None
        await until(lambda: rb.affinity is not None and rb.affinity.get(SESSION, 1.0) == first)
        assert _taken() == taken + 1
        # B holds a request of its own on that engine: alone, least load would send the next
        # turn to the other one
        fb.reserve(first, "b-own", RunningEntry(100, 10, 0.1, 0.0))
        turn = [
            *HISTORY,
            {"role": "assistant", "content": "Monday: dal."},
            {"role": "user", "content": "Tuesday?"},
        ]
        assert rb.index is not None
        cached = rb.index.cached_tokens(_prompt(turn), [first, other])
        assert cached[first] >= len(_prompt(HISTORY)) - 16 and cached[other] == 0
        assert _turn(rb, router_b, "t2", turn, now=1.5) == first
    finally:
        await _stop(ra, rb)


async def test_what_another_replica_routed_expires_as_a_dispatch_of_ones_own() -> None:
    (_, ra, router_a), (_, rb, _) = _pair(MemoryStore(), [True], clock=lambda: 10.0)
    try:
        await asyncio.sleep(0.01)
        first = _turn(ra, router_a, "t1", HISTORY, now=10.0)
        assert SESSION is not None and rb.index is not None and rb.affinity is not None
        await until(lambda: rb.affinity is not None and rb.affinity.get(SESSION, 10.0) == first)
        prompt = _prompt(HISTORY)
        assert rb.index.cached_tokens(prompt, [first])[first] > 0
        # the index's dispatch entries live 120 s (and up to an eighth more), the session 300 s,
        # from when B heard of them
        rb.index.expire(10.0 + 119.0)
        assert rb.index.cached_tokens(prompt, [first])[first] > 0
        rb.index.expire(10.0 + 120.0 * 1.125 + 1)
        assert rb.index.cached_tokens(prompt, [first])[first] == 0
        assert rb.affinity.get(SESSION, 10.0 + 299.0) == first
        assert rb.affinity.get(SESSION, 10.0 + 301.0) is None
    finally:
        await _stop(ra, rb)


async def test_a_session_without_a_prompt_is_shared_too() -> None:
    # (an embeddings request with a user, or a profile reading sessions without a prefix index:
    # the route names no block size)
    (_, ra, router_a), (_, rb, _) = _pair(MemoryStore(), [True])
    try:
        await asyncio.sleep(0.01)
        ra.attach("e1", None, SESSION)
        chosen = router_a.choose(RequestView("e1", MODEL, 200, 20), now=1.0)
        assert chosen is not None and SESSION is not None
        await until(lambda: rb.affinity is not None and rb.affinity.get(SESSION, 1.0) == chosen.engine_id)
    finally:
        await _stop(ra, rb)


async def test_nothing_is_sent_while_no_other_replica_is_known() -> None:
    store = MemoryStore()
    peers = [False]
    (_, ra, router_a), (_, rb, _) = _pair(store, peers)
    heard, listener = heard_on(store, "{slogate}:routes")
    try:
        await asyncio.sleep(0.01)
        _turn(ra, router_a, "t1", HISTORY, now=1.0)
        await asyncio.sleep(0.05)
        assert heard == [] and rb.affinity is not None and SESSION is not None
        assert rb.affinity.get(SESSION, 1.0) is None
        peers[0] = True
        _turn(ra, router_a, "t2", HISTORY, now=2.0)
        await until(lambda: len(heard) == 1)
        # (the one message: t2's route; t1's was never sent)
        routes = decode(heard[0])
        assert routes is not None and routes[0] == "ra" and [r.session for r in routes[1]] == [SESSION]
    finally:
        await cancelled(listener)
        await _stop(ra, rb)


async def test_dispatches_within_the_push_delay_go_in_one_message() -> None:
    store = MemoryStore()
    _, ra, router_a = _replica()
    routes = ReplicaRoutes(ra, store, "ra", lambda: True, push_delay_s=0.02)
    heard, listener = heard_on(store, routes.channel)
    routes.start()
    try:
        await asyncio.sleep(0.01)
        for i in range(5):
            _turn(ra, router_a, f"t{i}", HISTORY, now=1.0)
        await until(lambda: len(heard) == 1)
        await asyncio.sleep(0.05)
        decoded = decode(heard[0])
        assert len(heard) == 1 and decoded is not None and len(decoded[1]) == 5
    finally:
        await cancelled(listener)
        await routes.stop()


def _clocked(*replicas: tuple[str, float]) -> list[tuple[PrefixRouting, ReplicaRoutes]]:
    """Replicas whose routes are started (messages are handed between them by the test) and whose
    wall clocks read the times given; their monotonic clocks read 5.0."""
    made = []
    for replica_id, wall in replicas:
        _, routing, _ = _replica()
        routes = ReplicaRoutes(
            routing, MemoryStore(), replica_id, lambda: True, clock=lambda: 5.0, wall=lambda w=wall: w
        )
        routes.start()
        made.append((routing, routes))
    return made


async def test_two_replicas_dispatching_one_session_at_once_keep_the_same_engine() -> None:
    # A sends the session to m-0 at 1000.001 (wall clock), B to m-1 at 1000.002: each hears the
    # other's after its own; both must end with the later (m-1), not each with the other's
    (ra, routes_a), (rb, routes_b) = _clocked(("ra", 1000.001), ("rb", 1000.002))
    try:
        assert SESSION is not None and ra.affinity is not None and rb.affinity is not None
        for routing, engine in ((ra, f"{MODEL}-0"), (rb, f"{MODEL}-1")):
            routing.attach("same-session", None, SESSION)
            routing.dispatched("same-session", engine, 5.0)
        a_said, b_said = encode("ra", routes_a._pending), encode("rb", routes_b._pending)
        skipped = metrics.REPLICA_ROUTES.labels("skipped")._value.get()
        # (A takes B's later dispatch; B keeps its own: A's earlier one counts as skipped)
        assert routes_a.heard(b_said) == 1 and routes_b.heard(a_said) == 0
        assert metrics.REPLICA_ROUTES.labels("skipped")._value.get() == skipped + 1
        assert ra.affinity.get(SESSION, 5.0) == rb.affinity.get(SESSION, 5.0) == f"{MODEL}-1"
        # past the window a dispatch is no longer ordered against: what comes is taken
        routes_b.clock = lambda: 5.0 + STAMP_WINDOW_S + 1
        routes_b.heard(encode("ra", [Route(f"{MODEL}-0", 0, None, SESSION, 999.0)]))
        assert rb.affinity.get(SESSION, 5.0) == f"{MODEL}-0"
    finally:
        await routes_a.stop()
        await routes_b.stop()


async def test_a_dispatch_made_after_hearing_a_later_stamped_one_wins_everywhere() -> None:
    # B's clock runs ahead of A's: A hears B's dispatch of the session (stamped 1000.5), then
    # sends the session elsewhere itself at its own 1000.1. What A decided after hearing B's must
    # win on B too, or the replicas disagree until the window passes
    (ra, routes_a), (rb, routes_b) = _clocked(("ra", 1000.1), ("rb", 1000.5))
    try:
        assert SESSION is not None and ra.affinity is not None and rb.affinity is not None
        rb.attach("b1", None, SESSION)
        rb.dispatched("b1", f"{MODEL}-1", 5.0)
        assert routes_a.heard(encode("rb", routes_b._pending)) == 1
        assert ra.affinity.get(SESSION, 5.0) == f"{MODEL}-1"
        ra.attach("a2", None, SESSION)
        ra.dispatched("a2", f"{MODEL}-0", 5.0)
        [said] = routes_a._pending
        assert said.stamp > 1000.5
        assert routes_b.heard(encode("ra", [said])) == 1
        assert ra.affinity.get(SESSION, 5.0) == rb.affinity.get(SESSION, 5.0) == f"{MODEL}-0"
    finally:
        await routes_a.stop()
        await routes_b.stop()


def test_a_stamp_far_ahead_is_taken_but_orders_nothing_and_unknown_engines_order_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, MemoryStore(), "rb", lambda: True, clock=lambda: 5.0, wall=lambda: 1000.0)
    assert routing.affinity is not None
    far = Route(f"{MODEL}-0", 0, None, "s", 1000.0 + MAX_AHEAD_S + 60)
    assert routes.heard(encode("ra", [far])) == 1 and routing.affinity.get("s", 5.0) == f"{MODEL}-0"
    assert routes.heard(encode("ra", [far])) == 1
    assert sum("ahead of this replica's clock" in r.message for r in caplog.records) == 1
    # (not noted: an ordinary later route of the session is taken)
    assert routes.heard(encode("rc", [Route(f"{MODEL}-1", 0, None, "s", 999.0)])) == 1
    assert routing.affinity.get("s", 5.0) == f"{MODEL}-1"
    # a route for an engine this replica lacks orders nothing either
    routes.heard(encode("rd", [Route("elsewhere-0", 0, None, "t", 999.9)]))
    assert routes.heard(encode("ra", [Route(f"{MODEL}-0", 0, None, "t", 999.5)])) == 1
    assert routing.affinity.get("t", 5.0) == f"{MODEL}-0"


def test_the_order_remembers_a_bounded_number_of_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_routes, "MAX_STAMPS", 4)
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, MemoryStore(), "rb", lambda: True, clock=lambda: 5.0, wall=lambda: 1000.0)
    for i in range(10):
        routes.heard(encode("ra", [Route(f"{MODEL}-0", 0, None, f"s{i}", 999.0)]))
        assert len(routes._stamps) <= 4
    # a session remembered keeps its order however full the memory is, the oldest one too
    assert list(routes._stamps) == ["s6", "s7", "s8", "s9"]
    assert routes.heard(encode("rc", [Route(f"{MODEL}-1", 0, None, "s6", 998.0)])) == 0
    assert "s6" in routes._stamps and routing.affinity is not None
    assert routing.affinity.get("s6", 5.0) == f"{MODEL}-0"


def test_a_message_round_trips_every_64_bit_key_and_truncates_at_the_bound() -> None:
    keys = [0, 1, 2**63, 2**64 - 1, 12345678901234567890]
    sent = [
        Route("m-0", 16, keys, "s", 1764912000.25),
        Route("m-1", 32, None, "t"),
        Route("m-0", 16, keys, None),
    ]
    decoded = decode(encode("ra", sent))
    assert decoded == ("ra", sent)
    long = list(range(MAX_KEYS + 10))
    decoded = decode(encode("ra", [Route("m-0", 16, long, None)]))
    assert decoded is not None and decoded[1][0].keys == long[:MAX_KEYS]


def _doc(*routes: object, v: object = FORMAT, r: object = "ra") -> bytes:
    return orjson.dumps({"v": v, "r": r, "routes": list(routes)})


PACKED = base64.b64encode(np.asarray([1, 2], dtype="<u8").tobytes()).decode()


@pytest.mark.parametrize(
    "message",
    [
        b"not json",
        b"[]",
        _doc(["m-0", 16, PACKED, None, 0.0], v=1),  # (routes without their dispatch's time)
        _doc(["m-0", 16, PACKED, None, 0.0], r="r" * 257),
        _doc(["m-0", 16, PACKED, None, 0.0], r=5),
        _doc(["m-0", 16, PACKED]),
        _doc(["m-0", 16, PACKED, None]),  # (no stamp)
        _doc(["m-0", 16, PACKED, None, "noon"]),
        _doc(["m-0", 16, PACKED, None, -1.0]),
        _doc(["m-0", 16, PACKED, None, 1e12]),
        _doc(["m-0", 16, PACKED, None, True]),
        _doc(["m-0", True, PACKED, None, 0.0]),
        _doc(["m-0", 0, PACKED, None, 0.0]),
        _doc(["m-0", 16, "not base64!", None, 0.0]),
        _doc(["m-0", 16, base64.b64encode(b"\x01\x02\x03").decode(), None, 0.0]),
        _doc(["m-0", 16, "", None, 0.0]),
        _doc(["m-0", 16, None, None, 0.0]),
        _doc(["m-0", 16, None, "", 0.0]),
        _doc(["m-0", 16, None, "x" * 260, 0.0]),
        _doc([7, 16, PACKED, None, 0.0]),
        # (one bad route spoils the message: nothing of it is taken)
        _doc(["m-0", 16, PACKED, "s", 0.0], ["m-0", 16, 5, None, 0.0]),
        orjson.dumps({"v": FORMAT, "r": "ra", "routes": [["m-0", 16, None, "s", 0.0]] * (MAX_ROUTES + 1)}),
    ],
)
def test_a_message_this_version_does_not_write_is_not_read(message: bytes) -> None:
    assert decode(message) is None
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, MemoryStore(), "rb", lambda: True)
    assert routes.heard(message) == 0
    assert routing.affinity is not None and len(routing.affinity) == 0  # type: ignore[arg-type]


def test_a_message_past_its_bounds_is_not_read() -> None:
    per_route = [[f"{MODEL}-0", 16, base64.b64encode(bytes(8 * MAX_KEYS)).decode(), None, 0.0]]
    assert decode(_doc(*per_route * (MAX_MESSAGE_KEYS // MAX_KEYS))) is not None
    assert decode(_doc(*per_route * (MAX_MESSAGE_KEYS // MAX_KEYS + 1))) is None
    too_many_keys = base64.b64encode(bytes(8 * (MAX_KEYS + 1))).decode()
    assert decode(_doc([f"{MODEL}-0", 16, too_many_keys, None, 0.0])) is None
    assert decode(_doc([f"{MODEL}-0", 16, None, "s", 0.0]) + b" " * MAX_MESSAGE_BYTES) is None


async def test_the_sender_drops_routes_past_a_messages_key_budget() -> None:
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, MemoryStore(), "ra", lambda: True, push_delay_s=3600)
    routes.start()
    try:
        dropped = metrics.REPLICA_ROUTES.labels("dropped")._value.get()
        long = list(range(MAX_KEYS + 100))
        for _ in range(MAX_MESSAGE_KEYS // MAX_KEYS + 1):
            routes._routed(f"{MODEL}-0", 16, long, None)
        assert [len(r.keys or ()) for r in routes._pending] == [MAX_KEYS] * (MAX_MESSAGE_KEYS // MAX_KEYS)
        assert metrics.REPLICA_ROUTES.labels("dropped")._value.get() == dropped + 1
        routes._routed(f"{MODEL}-0", 16, None, "a session costs no key")
        assert len(routes._pending) == MAX_MESSAGE_KEYS // MAX_KEYS + 1
    finally:
        await routes.stop()


async def test_the_key_budget_is_a_messages_and_a_session_goes_without_its_keys_past_it() -> None:
    store = MemoryStore()
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, store, "ra", lambda: True, push_delay_s=0.001)
    heard, listener = heard_on(store, routes.channel)
    routes.start()
    try:
        await asyncio.sleep(0.01)
        keys = list(range(MAX_KEYS))
        for _ in range(2):  # (a full message's worth each time: the budget frees with each push)
            for _i in range(MAX_MESSAGE_KEYS // MAX_KEYS):
                routes._routed(f"{MODEL}-0", 16, keys, None)
            routes._routed(f"{MODEL}-1", 16, keys, "late session")
            await until(lambda: not routes._pending)
        await until(lambda: len(heard) == 2)
        for message in heard:
            decoded = decode(message)
            assert decoded is not None
            assert [len(r.keys or ()) for r in decoded[1]] == [MAX_KEYS] * 4 + [0]
            last = decoded[1][-1]
            assert (last.engine_id, last.keys, last.session) == (f"{MODEL}-1", None, "late session")
    finally:
        await cancelled(listener)
        await routes.stop()


async def test_a_batch_too_long_for_the_receivers_goes_in_parts() -> None:
    store = MemoryStore()
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, store, "ra", lambda: True)
    heard, listener = heard_on(store, routes.channel)
    try:
        await asyncio.sleep(0.01)
        engine = "e" * 5000  # (engine ids are not bounded: 256 of these pass 1 MiB)
        sent = metrics.REPLICA_ROUTES.labels("sent")._value.get()
        await routes.push([Route(engine, 16, [i], f"session-{i}") for i in range(MAX_ROUTES)])
        await until(lambda: sum(len(decode(m)[1]) for m in heard if decode(m)) == MAX_ROUTES)  # type: ignore[index]
        assert len(heard) >= 2 and all(len(m) <= MAX_MESSAGE_BYTES for m in heard)
        assert metrics.REPLICA_ROUTES.labels("sent")._value.get() == sent + MAX_ROUTES
        dropped = metrics.REPLICA_ROUTES.labels("dropped")._value.get()
        await routes.push([Route("e" * (MAX_MESSAGE_BYTES + 1), 16, [1], None)])
        assert metrics.REPLICA_ROUTES.labels("dropped")._value.get() == dropped + 1
    finally:
        await cancelled(listener)


def test_a_message_not_taken_is_counted_as_rejected() -> None:
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, MemoryStore(), "rb", lambda: True)
    rejected = metrics.REPLICA_ROUTES.labels("rejected")._value.get()
    assert routes.heard(b"not json") == 0
    assert routes.heard(encode("ra", [Route(f"{MODEL}-0", 0, None, "s")])) == 1
    assert metrics.REPLICA_ROUTES.labels("rejected")._value.get() == rejected + 1


def test_routes_for_an_unknown_engine_or_another_block_size_are_skipped_and_its_own_ignored() -> None:
    _, routing, _ = _replica(block_size=16)
    routes = ReplicaRoutes(routing, MemoryStore(), "rb", lambda: True)
    keys = _prompt(HISTORY).hashes(16)
    assert routes.heard(encode("ra", [Route("elsewhere-0", 16, keys, "s")])) == 0
    assert routes.heard(encode("ra", [Route(f"{MODEL}-0", 32, _prompt(HISTORY).hashes(32), None)])) == 0
    assert routing.index is not None and routing.index.entries(f"{MODEL}-0") == 0
    # a session is taken whatever the block size; keys only at this index's (not whole: skipped)
    skipped = metrics.REPLICA_ROUTES.labels("skipped")._value.get()
    assert routes.heard(encode("ra", [Route(f"{MODEL}-0", 32, keys, "s")])) == 0
    assert metrics.REPLICA_ROUTES.labels("skipped")._value.get() == skipped + 1
    assert routing.index.entries(f"{MODEL}-0") == 0
    assert routing.affinity is not None and routing.affinity.get("s", 1.0) == f"{MODEL}-0"
    assert routes.heard(encode("ra", [Route(f"{MODEL}-1", 16, keys, None)])) == 1
    assert routing.index.entries(f"{MODEL}-1") == len(keys)
    # its own messages (every replica hears them) are not taken again
    assert routes.heard(encode("rb", [Route(f"{MODEL}-0", 16, keys, None)])) == 0
    assert routing.index.entries(f"{MODEL}-0") == 0


class DownStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def publish(self, channel: str, message: bytes) -> None:
        if self.down:
            raise StoreError("down")
        await super().publish(channel, message)


async def test_a_store_out_of_reach_loses_those_routes_only(caplog: pytest.LogCaptureFixture) -> None:
    store = DownStore()
    _, routing, _ = _replica()
    routes = ReplicaRoutes(routing, store, "ra", lambda: True)
    errors = metrics.STATE_STORE_ERRORS._value.get()
    await routes.push([Route(f"{MODEL}-0", 16, [1, 2], "s")])
    await routes.push([Route(f"{MODEL}-0", 16, [1, 2], "s")])
    assert metrics.STATE_STORE_ERRORS._value.get() == errors + 2
    assert sum("routes are not shared" in r.message for r in caplog.records) == 1  # (once an outage)
    store.down = False
    heard, listener = heard_on(store, routes.channel)
    try:
        await asyncio.sleep(0.01)
        await routes.push([Route(f"{MODEL}-0", 16, [1, 2], "s")])
        await until(lambda: len(heard) == 1)
    finally:
        await cancelled(listener)


async def test_a_store_that_falls_behind_drops_routes_rather_than_holding_them() -> None:
    _, routing, router = _replica()
    routes = ReplicaRoutes(routing, MemoryStore(), "ra", lambda: True, push_delay_s=3600)
    routes.start()
    try:
        dropped = metrics.REPLICA_ROUTES.labels("dropped")._value.get()
        for i in range(MAX_ROUTES + 3):
            routing.attach(f"r{i}", None, f"session-{i}")
            assert router.choose(RequestView(f"r{i}", MODEL, 200, 20), now=1.0) is not None
        assert len(routes._pending) == MAX_ROUTES
        assert metrics.REPLICA_ROUTES.labels("dropped")._value.get() == dropped + 3
    finally:
        await routes.stop()
    assert routing.route_listener is None


# -- a replica that starts later learns the sessions dispatched before it -----------------------


def _started(
    store: MemoryStore, replica: str, peers: bool, clock: Callable[[], float], wall: Callable[[], float]
) -> tuple[Fleet, PrefixRouting, Router, ReplicaRoutes]:
    fleet, routing, router = _replica()
    routes = ReplicaRoutes(
        routing,
        store,
        replica,
        lambda: peers,
        push_delay_s=0.001,
        clock=clock,
        wall=wall,
        sessions_ttl_s=300.0,
    )
    routes.start()
    return fleet, routing, router, routes


async def test_a_replica_started_later_learns_the_sessions_dispatched_before_it() -> None:
    """A conversation whose turns came through replica A before B started (a scale-out, or B
    replacing A in a rolling update) went by load on B: its history prefilled again on a cold
    engine. A writes each session's dispatch under its own key (with no other replica running
    too), and B reads them all at its start, each aged by when it was dispatched."""
    store = MemoryStore()
    now = [100.0]
    wall = [5_000.0]
    _, ra, router_a, routes_a = _started(store, "ra", False, lambda: now[0], lambda: wall[0])
    try:
        first = _turn(ra, router_a, "t1", HISTORY, now=100.0)
        ra.attach("e1", None, "other-session")
        other = router_a.choose(RequestView("e1", MODEL, 200, 20), now=100.0)
        assert other is not None
        await until(lambda: len([k for k in store._values if k.startswith(routes_a.session_prefix)]) == 2)
    finally:
        await routes_a.stop()
    now[0], wall[0] = 500.0, 5_060.0  # B starts a minute later (its own monotonic clock)
    fb, rb, router_b, routes_b = _started(store, "rb", False, lambda: now[0], lambda: wall[0])
    try:
        assert SESSION is not None and rb.affinity is not None
        await until(lambda: rb.affinity is not None and rb.affinity.get(SESSION, 500.0) == first)
        assert rb.affinity.get("other-session", 500.0) == other.engine_id
        # B's own request holds that engine: alone, least load would send the turn elsewhere
        fb.reserve(first, "b-own", RunningEntry(100, 10, 0.1, 0.0))
        rb.attach("t2", None, SESSION)
        chosen = router_b.choose(RequestView("t2", MODEL, 200, 20), now=500.5)
        assert chosen is not None and chosen.engine_id == first
        # aged by its dispatch: the session map's 300 s run from a minute before B heard of it
        # (read last: an expired entry is dropped as it is read)
        assert rb.affinity.get("other-session", 500.0 + 239.0) == other.engine_id
        assert rb.affinity.get("other-session", 500.0 + 241.0) is None
    finally:
        await routes_b.stop()


async def test_recovery_skips_what_it_should_and_keeps_what_the_replica_knows() -> None:
    store = MemoryStore()
    now, wall = (lambda: 10.0), (lambda: 1_000.0)
    fleet, routing, _, routes = _started(store, "rb", False, now, wall)
    await routes.stop()  # (recovery is driven by hand below)
    assert routing.affinity is not None
    engine, other = list(fleet.records)
    prefix = routes.session_prefix
    routing.affinity.put("known-here", other, 9.0)
    await store.put_many(
        [
            (prefix + "fresh", orjson.dumps([engine, 990.0, "ra"])),
            (prefix + "expired", orjson.dumps([engine, 1_000.0 - 300.0, "ra"])),
            (prefix + "unknown-engine", orjson.dumps(["elsewhere-0", 990.0, "ra"])),
            (prefix + "known-here", orjson.dumps([engine, 995.0, "ra"])),
            (prefix + "malformed", b"[1, 2"),
            (prefix + "wrong-shape", orjson.dumps({"engine": engine})),
            (prefix + "bad-stamp", orjson.dumps([engine, -1.0, "ra"])),
            ("{slogate}:sessionless", orjson.dumps([engine, 990.0, "ra"])),
        ],
        600.0,
    )
    rejected = metrics.REPLICA_ROUTES.labels("rejected")._value.get()
    assert await routes.recover_sessions() == 1
    assert metrics.REPLICA_ROUTES.labels("rejected")._value.get() == rejected + 3
    assert routing.affinity.get("fresh", 10.0) == engine
    assert routing.affinity.get("known-here", 10.0) == other  # (not overwritten)
    for absent in ("expired", "unknown-engine", "malformed", "wrong-shape", "bad-stamp"):
        assert routing.affinity.get(absent, 10.0) is None


async def test_a_store_out_of_reach_at_start_recovers_nothing_and_raises_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Unreachable(MemoryStore):
        async def scan(self, prefix: str, batch: int = 512):  # type: ignore[no-untyped-def,override]
            raise StoreError("redis at redis://nowhere: refused")
            yield []

    _, _, _, routes = _started(Unreachable(), "rb", False, lambda: 1.0, lambda: 1.0)
    await routes.stop()
    assert await routes.recover_sessions() == 0
    assert "were not read" in caplog.text


async def test_sessions_waiting_to_be_written_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_routes, "MAX_PENDING_SESSIONS", 3)
    store = MemoryStore()
    _, routing, router, routes = _started(store, "ra", False, lambda: 1.0, lambda: 1.0)
    await routes.stop()  # (nothing pushes: what waits stays)
    routes._started, routing.route_listener = True, routes._routed
    for i in range(10):
        routing.attach(f"r{i}", None, f"s{i}")
        assert router.choose(RequestView(f"r{i}", MODEL, 200, 20), now=1.0) is not None
    routing.attach("again", None, "s0")
    assert router.choose(RequestView("again", MODEL, 200, 20), now=1.0) is not None
    assert sorted(routes._sessions) == ["s0", "s1", "s2"]


async def test_recovery_takes_at_most_half_the_session_map_and_a_stamp_ahead_orders_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read in the store's order into a least-recently-used map, recovered sessions pushed out
    the ones the replica routed itself meanwhile (the freshest); and a stamp far ahead of this
    replica's clock was noted, beating honest routes for the window, where one heard is not."""
    store = MemoryStore()
    fleet, _, _ = _replica()
    engine = next(iter(fleet.records))
    routing = PrefixRouting(
        fleet, PrefixIndex(1 << 24, 120.0), MemoryAffinityStore(ttl_s=300.0, max_entries=10)
    )
    routes = ReplicaRoutes(routing, store, "rb", lambda: False, clock=lambda: 10.0, wall=lambda: 1_000.0)
    prefix = routes.session_prefix
    await store.put_many([(prefix + f"s{i}", orjson.dumps([engine, 990.0, "ra"])) for i in range(30)], 600.0)
    await store.put_many([(prefix + "ahead", orjson.dumps([engine, 1_000.0 + 60.0, "ra"]))], 600.0)
    assert await routes.recover_sessions() == 5
    assert routing.affinity is not None and len(routing.affinity) == 5
    ahead = PrefixRouting(fleet, PrefixIndex(1 << 24, 120.0), MemoryAffinityStore(ttl_s=300.0))
    late = ReplicaRoutes(ahead, store, "rc", lambda: False, clock=lambda: 10.0, wall=lambda: 1_000.0)
    assert await late.recover_sessions() == 31
    assert ahead.affinity is not None and ahead.affinity.get("ahead", 10.0) == engine
    assert late._known("ahead") is None  # (taken, but orders nothing)


async def test_session_writes_failing_alone_are_told_apart_from_the_routes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that takes PUBLISH and refuses SET (full with noeviction, or an ACL without the
    session keys): the routes and the sessions shared one flag, and each push logged the store
    unreachable, then reachable again."""

    class NoWrites(MemoryStore):
        async def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float) -> None:
            raise StoreError("OOM command not allowed when used memory > 'maxmemory'")

    store = NoWrites()
    (_, ra, router_a), (_, rb, _) = _pair(store, [True])
    try:
        await asyncio.sleep(0.01)
        for i in range(5):
            _turn(ra, router_a, f"t{i}", HISTORY, now=1.0 + i)
            await asyncio.sleep(0.02)
        assert rb.affinity is not None and SESSION is not None and rb.affinity.get(SESSION, 5.0) is not None
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert sum("sessions are not written" in w for w in warnings) == 1, warnings
        assert not any("unreachable" in w or "reachable again" in w for w in warnings), warnings
    finally:
        await _stop(ra, rb)


async def test_new_sessions_written_to_the_store_are_budgeted_and_rewrites_are_free() -> None:
    """Client-chosen session ids sprayed at thousands a second each became a key for the TTL:
    millions of them, on a Redis that evicts none, or that evicted real sessions for them. A
    replica adds at most max_sessions keys per TTL (burst included); rewriting one it wrote
    within the TTL adds none and always goes."""
    store = MemoryStore()
    now = [1.0]
    _, routing, router, routes = _started(store, "ra", False, lambda: now[0], lambda: 1.0)
    await routes.stop()  # (nothing pushes: what waits stays)
    routes._started, routing.route_listener = True, routes._routed
    routes.max_sessions, routes._budget, routes._budget_at = 4, 4.0, now[0]  # (4 per 300 s)
    unwritten = metrics.REPLICA_ROUTES.labels("unwritten")._value.get()

    def dispatch(session: str) -> None:
        routing.attach(f"r-{session}-{now[0]}", None, session)
        assert router.choose(RequestView(f"r-{session}-{now[0]}", MODEL, 200, 20), now=now[0]) is not None

    for i in range(10):
        dispatch(f"sprayed-{i}")
    assert sorted(routes._sessions) == [f"sprayed-{i}" for i in range(4)]
    assert metrics.REPLICA_ROUTES.labels("unwritten")._value.get() == unwritten + 6
    routes._sessions.clear()
    dispatch("sprayed-0")  # (its key is there: a rewrite goes, past the budget)
    assert list(routes._sessions) == ["sprayed-0"]
    now[0] += 75.0  # a quarter of the TTL: room for one more new key
    dispatch("new-a")
    dispatch("new-b")
    assert sorted(routes._sessions) == ["new-a", "sprayed-0"]
    # the local map is bounded too: what was written longest ago is forgotten first
    assert len(routes._written) <= routes.max_sessions


async def test_slow_session_writes_do_not_hold_back_the_routes() -> None:
    """Routes and session writes took turns in one task: a pipeline of writes slow to answer held
    the pushes back, and the routes waiting meanwhile passed MAX_ROUTES and were dropped while
    PUBLISH itself was healthy."""
    release = asyncio.Event()

    class SlowWrites(MemoryStore):
        async def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float) -> None:
            await release.wait()
            await super().put_many(items, ttl_s)

    store = SlowWrites()
    _, routing, router, routes = _started(store, "ra", True, time.monotonic, time.time)
    heard: list[bytes] = []
    listener = asyncio.create_task(_collect(store, routes.channel, heard))
    try:
        await asyncio.sleep(0.05)  # (subscribed)
        for i in range(3):
            routing.attach(f"r{i}", None, f"s{i}")
            assert router.choose(RequestView(f"r{i}", MODEL, 200, 20), now=1.0) is not None
            await asyncio.sleep(0.02)  # (a push each)
        await until(lambda: len(heard) >= 2)  # ...while the first session write still waits
        assert not release.is_set() and not [k for k in store._values if k.startswith(routes.session_prefix)]
        release.set()
        await until(lambda: len([k for k in store._values if k.startswith(routes.session_prefix)]) == 3)
    finally:
        release.set()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await routes.stop()


async def _collect(store: MemoryStore, channel: str, into: list[bytes]) -> None:
    async for message in store.subscribe(channel):
        into.append(message)
