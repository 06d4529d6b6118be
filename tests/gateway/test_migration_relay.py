"""A continuation's relay (gateway.serving.migration.Migrator._relay) against a real engine socket.

The ledger of a migrating stream is what the next engine continues from, so it must hold exactly
what the client was sent: a token recorded but never relayed is lost from the answer for good.
The continuation engine here is a stub that writes its events in one piece, so that a token
event and a failure arrive in the same read.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway import metrics
from gateway.api.errors import GatewayError
from gateway.api.request_parse import parse_request
from gateway.dispatch.offline import fleet_of, offline_fleet
from gateway.fleet.registry import RunningEntry
from gateway.serving.call import Call
from gateway.serving.migration import Migrator, _Resume, _Shape
from gateway.serving.stream_state import Cut, StreamLedger
from gateway.settings import EngineConfig, Settings
from policies.migration import MigrationReason
from policies.slo import SloSource, SloTarget
from tests.gateway.stub_engines import StubEngine
from tests.gateway.test_relay_framing import relay_on

TOKEN = b'data: {"choices":[{"index":0,"text":" nine","token_ids":[9],"finish_reason":null}]}\n\n'
FAILURE = b'data: {"error":{"message":"engine died","code":500}}\n\n'
MALFORMED = b"data: {not json\n\n"


class _Flow:
    """What the migrator reads of its flow here: the settings, the fleet, and its dispatch's
    release (the end of a stream gives the engine back)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = Settings(**settings)
        self.fleet = offline_fleet({"m": 1})
        self.dispatch = self

    def release(self, engine_id: str, rid: str) -> None:
        self.fleet.release(engine_id, rid)


async def _relay_once(
    url: str,
    restart: bool = False,
    first_token_s: float = 5.0,
    kind: str = "completions",
    prompt_ids: list[int] | None = None,
    idle_s: float | None = None,
    calls: list[Call] | None = None,
    **body: Any,
) -> tuple[int | Cut, list[int], bytes]:
    """One continuation (or, with ``restart``, a restart: nothing relayed before) from ``url``;
    ``calls`` gets the request's call."""
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    flow = _Flow() if idle_s is None else _Flow(idle_timeout_s=idle_s)
    migrator = Migrator(flow)  # type: ignore[arg-type]
    call = _call(send, kind, **body)
    if calls is not None:
        calls.append(call)
    record = next(iter(flow.fleet.records.values()))
    entry = RunningEntry(1, 16, 0.1, 0.0)
    flow.fleet.reserve(record.engine_id, call.rid, entry)
    ledger = StreamLedger()
    state = None
    if not restart:
        ledger.extend([7, 8])  # what the first engine relayed before it failed
        state = _Resume(
            prompt_ids or [1, 2, 3],
            _Shape(kind, {"id": "cmpl-1", "created": 0, "model": "m"}),
            16,
            None,
            None,
        )
    loop = asyncio.get_running_loop()
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json={}) as response,
    ):
        outcome = await migrator._relay(
            call, ledger, state, record, entry, response, loop.time() + first_token_s
        )
    return outcome, ledger.tokens(), b"".join(sent)


def _call(send: Any, kind: str = "completions", **body: Any) -> Call:
    fields = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    request = parse_request(kind, orjson.dumps({"model": "m", **fields, "stream": True, **body}), 16)  # type: ignore[arg-type]
    return Call(
        request, "rid-1", "rid-1", 0.0, send, SloTarget(1.0, 0.1, "default", SloSource.DEFAULT), None, (), {}
    )


def _engine(events: bytes) -> StubEngine:
    async def behaviour(_: StubEngine, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(events)  # one write: one read at the gateway
        await response.write_eof()
        return response

    return StubEngine(behaviour)


def test_a_token_read_together_with_a_failure_reaches_the_client_before_the_cut() -> None:
    for failure in (FAILURE, MALFORMED):
        with _engine(TOKEN + failure) as engine:
            outcome, tokens, sent = asyncio.run(_relay_once(engine.url))
        assert isinstance(outcome, Cut) and outcome.error is not None
        # the next engine continues after token 9, so the client must have its text
        assert tokens == [7, 8, 9]
        assert b" nine" in sent and b"[9]" in sent


def test_a_continuation_echoing_a_long_prompts_ids_is_relayed() -> None:
    """A continuation's prompt is the client's ids and the output's; an engine that echoes them
    in its first event (about 4.9 MB for 700k tokens) was cut as "an oversized event"."""
    prompt_ids = list(range(100_000, 800_000))
    echo = (
        b'data: {"id":"x","prompt_token_ids":' + orjson.dumps([*prompt_ids, 7, 8]) + b',"choices":'
        b'[{"index":0,"text":" nine","token_ids":[9],"finish_reason":"length"}]}\n\n'
    )
    relayed = metrics.REGISTRY.get_sample_value("slogate_sse_events_relayed_total") or 0.0
    with _engine(echo + b"data: [DONE]\n\n") as engine:
        outcome, tokens, sent = asyncio.run(_relay_once(engine.url, prompt_ids=prompt_ids))
    assert outcome == 200 and tokens == [7, 8, 9]
    # counted as the first engine's events are: every event the client got, its end included
    # (the continuation's went uncounted, then its finish, usage and [DONE])
    counted = (metrics.REGISTRY.get_sample_value("slogate_sse_events_relayed_total") or 0.0) - relayed
    assert counted == sent.count(b"data: ") == 2
    assert b" nine" in sent and sent.endswith(b"data: [DONE]\n\n") and b'"error"' not in sent


def test_a_failure_alone_records_nothing_and_sends_nothing() -> None:
    with _engine(FAILURE) as engine:
        outcome, tokens, sent = asyncio.run(_relay_once(engine.url))
    assert isinstance(outcome, Cut)
    assert tokens == [7, 8] and sent == b""


def test_a_batch_of_completions_prompts_is_never_migrated() -> None:
    """Each prompt of a completions batch is its own choice; a ledger collected every choice's
    token ids into one list, and a continuation resumed only the first prompt from it."""
    flow = _Flow()
    migrator = Migrator(flow)  # type: ignore[arg-type]
    record = next(iter(flow.fleet.records.values()))
    target = SloTarget(1.0, 0.1, "default", SloSource.DEFAULT)

    def ledger_for(prompt: object) -> StreamLedger | None:
        raw = orjson.dumps({"model": "m", "prompt": prompt, "stream": True})
        call = Call(parse_request("completions", raw, 16), "r", "r", 0.0, _ignore, target, None, (), {})
        return migrator.ledger(call, record)

    for single in ("one", ["one"], [11, 12, 13], [[11, 12]]):
        ledger = ledger_for(single)
        assert ledger is not None and ledger.blocked is None, single
    for batch in (["one", "two"], [[11, 12], [13]]):
        ledger = ledger_for(batch)
        assert ledger is not None and ledger.blocked is not None and "batch of 2" in ledger.blocked
    # parsed in a worker (the summary carries no body): known all the same
    summary = parse_request(
        "completions", orjson.dumps({"model": "m", "prompt": ["a", "b", "c"], "stream": True}), 16
    ).summary()
    assert summary.prompts == 3 and summary.parsed is None
    ledger = migrator.ledger(Call(summary, "r", "r", 0.0, _ignore, target, None, (), {}), record)
    assert ledger is not None and ledger.blocked is not None and "batch of 3" in ledger.blocked


async def _ignore(_: dict[str, Any]) -> None:
    return None


def test_a_stream_whose_output_the_engine_parses_stops_being_recorded_and_cannot_migrate() -> None:
    """A reasoning parser's or a tool call's deltas: a resumed stream (plain completions of the
    token ids, or a restart's events re-shaped to content) would carry them as text, or drop them."""
    head = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[4],"finish_reason":null}]}\n\n'
    for parsed in (
        b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"},"token_ids":[5]}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"reasoning":"hm"},"token_ids":[5]}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c"}]},"token_ids":[5]}]}\n\n',
    ):
        ledger = StreamLedger()
        ledger.feed(head, 1, 0.0)
        assert ledger.tracking and ledger.tokens() == [4]
        assert ledger.feed(parsed, 1, 0.1) is False
        assert not ledger.tracking and ledger.blocked is not None and "parses" in ledger.blocked
        ledger.feed(head, 1, 0.2)  # nothing more is recorded
        assert ledger.tokens() == [4]
    plain = StreamLedger()
    plain.feed(head.replace(b'"a"', b'"the \\"reasoning\\":\\"x\\" of it"'), 1, 0.0)
    assert plain.tracking and plain.blocked is None  # (quoted in text, not a delta's key)


@pytest.mark.parametrize(
    "bad",
    [
        b'data: {"choices":["x"]}\n\n',
        b'data: {"choices":{"0":1}}\n\n',
        b"data: [1,2]\n\n",
        b'data: {"choices":[{"index":0,"text":" ten","token_ids":["10"]}]}\n\n',
        b'data: {"choices":[{"index":0,"text":5,"token_ids":[10]}]}\n\n',
        # an error as older vLLM wrote one, then its [DONE]: ended as a whole answer, cut short
        b'data: {"object":"error","message":"out of memory","code":500}\n\ndata: [DONE]\n\n',
        # a finish reason nested past what the chunk could be written with again (a TypeError)
        b'data: {"choices":[{"index":0,"text":" ten","token_ids":[10],"finish_reason":'
        + b"[" * 300
        + b"]" * 300
        + b"}]}\n\n",
    ],
    ids=[
        "choice-not-object",
        "choices-not-list",
        "not-object",
        "ids-not-ints",
        "text-not-string",
        "older-error-shape",
        "nested-finish",
    ],
)
def test_a_malformed_continuation_event_is_a_cut_after_what_came_before(bad: bytes) -> None:
    """A continuation event that is JSON but not a completion chunk raised past the relay's
    handler: the client's stream was dropped with no error event and no [DONE], and an id read
    with it was in the ledger without having been sent."""
    with _engine(TOKEN + bad) as engine:
        outcome, tokens, sent = asyncio.run(_relay_once(engine.url))
    assert isinstance(outcome, Cut) and outcome.error is not None and outcome.error.status == 502
    assert tokens == [7, 8, 9] and sent.count(b"data: ") == 1 and b" nine" in sent


@pytest.mark.parametrize("usage_came", [True, False])
def test_a_stream_cut_after_its_finish_ends_whole_not_with_an_error(usage_came: bool) -> None:
    """An engine that cut the connection after the finish chunk (and the usage) but before
    [DONE]: the answer was whole, yet a stream past its migration limit ended with an error
    event, and one within it had its usage counted and sent twice."""

    async def run() -> tuple[int, bytes, int | None]:
        sent: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b""))

        flow = _Flow()
        migrator = Migrator(flow)  # type: ignore[arg-type]
        body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
        request = parse_request("completions", orjson.dumps(body), 16)
        call = Call(
            request,
            "rid-1",
            "rid-1",
            0.0,
            send,
            SloTarget(1.0, 0.1, "default", SloSource.DEFAULT),
            None,
            (),
            {},
        )
        call.ledger = ledger = StreamLedger()
        ledger.migrations = 99  # past any limit: a failure here is never resumed
        ledger.feed(
            b'data: {"id":"c","created":0,"model":"m","prompt_token_ids":[1,2],"choices":[{"index":0,'
            b'"text":" nine","token_ids":[9],"finish_reason":"stop"}]}\n\n',
            1,
            0.0,
        )
        if usage_came:
            call.completion_tokens, call.usage_told = 1, True
        cut = Cut(MigrationReason.FAILURE, "m-0", GatewayError(502, "cut", code="upstream_failed"))
        status = await migrator.resume(call, cut, [])
        return status, b"".join(sent), call.completion_tokens

    status, sent, completion = asyncio.run(run())
    assert status == 200 and b'"error"' not in sent and sent.endswith(b"data: [DONE]\n\n")
    assert sent.count(b'"usage"') == (0 if usage_came else 1)
    if not usage_came:
        assert completion == 1  # counted from what was relayed (the test set it when told)


def test_a_stream_with_running_usage_cut_after_its_finish_still_gets_its_usage_chunk() -> None:
    """``continuous_usage_stats``: every chunk carries the running usage, the finish chunk too.
    An engine cut after the finish chunk but before the usage-only chunk: the stream was taken
    for whole because a usage figure had come, and the client that asked for usage never got
    its usage chunk."""
    running = (
        b',"usage":{"prompt_tokens":2,"completion_tokens":%d,"total_tokens":%d,'
        b'"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
    )
    first = (
        b'data: {"id":"c","created":0,"model":"a","prompt_token_ids":[1,2],"choices":[{"index":0,'
        b'"text":" nine","token_ids":[9],"finish_reason":null}]' + running % (1, 3)
    )
    finish = (
        b'data: {"choices":[{"index":0,"text":" ten","token_ids":[10],"finish_reason":"stop"}]'
        + running
        % (
            2,
            4,
        )
    )

    async def run() -> tuple[int, bytes, bytes]:
        ledger = StreamLedger()
        outcome, relayed, call, _ = await relay_on([first, finish], ledger, wants_usage=True)
        assert isinstance(outcome, Cut)  # (no [DONE]: the engine's connection ended)
        sent: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b""))

        call.send, call.ledger = send, ledger
        status = await Migrator(_Flow()).resume(call, outcome, [])  # type: ignore[arg-type]
        return status, relayed, b"".join(sent)

    status, relayed, tail = asyncio.run(run())
    assert relayed == first + finish
    assert status == 200 and b'"error"' not in tail and tail.endswith(b"data: [DONE]\n\n")
    events = [orjson.loads(line[6:]) for line in tail.split(b"\n\n") if line.startswith(b"data: {")]
    assert len(events) == 1 and events[0]["choices"] == []  # no second finish, one usage chunk
    assert events[0]["usage"]["completion_tokens"] == 2 and events[0]["usage"]["prompt_tokens"] == 2
    assert events[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}  # (the engine's word)


@pytest.mark.parametrize("ids", [b"[1,[2]]", b'["a"]', b"[-1]", b"[4294967296]"])
def test_malformed_token_ids_end_the_stream_with_an_error_event(ids: bytes) -> None:
    """Ids the first engine sent malformed: the resumption read them as JSON and raised past
    every handler (``[1,[2]]``), the client's stream dropped with no error event and no
    [DONE]; or it resumed from ids no engine can take back (negative, past 32 bits)."""

    async def run() -> tuple[int, bytes, StreamLedger]:
        sent: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b""))

        migrator = Migrator(_Flow(migration_limit=2))  # type: ignore[arg-type]
        call = _call(send)
        call.ledger = ledger = StreamLedger()
        ledger.feed(
            b'data: {"id":"c","created":0,"model":"m","prompt_token_ids":[1,2],"choices":[{"index":0,'
            b'"text":" a","token_ids":' + ids + b',"finish_reason":null}]}\n\n',
            1,
            0.0,
        )
        cut = Cut(MigrationReason.FAILURE, "m-0", GatewayError(502, "engine died", code="upstream_failed"))
        return await migrator.resume(call, cut, []), b"".join(sent), ledger

    status, sent, ledger = asyncio.run(run())
    assert status == 502 and b'"error"' in sent and sent.endswith(b"data: [DONE]\n\n")
    assert ledger.blocked is not None and "malformed" in ledger.blocked and ledger.tokens() == []


def test_a_continuation_s_usage_past_any_count_is_not_believed() -> None:
    """An engine reporting 2**64 - 1 completion tokens: the usage chunk could not be written
    (orjson refuses integers past 64 bits) and the stream was dropped without [DONE]."""
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":18446744073709551615}}\n\n'
    with _engine(TOKEN + usage + b"data: [DONE]\n\n") as engine:
        outcome, tokens, sent = asyncio.run(_relay_once(engine.url, stream_options={"include_usage": True}))
    assert outcome == 200 and tokens == [7, 8, 9] and sent.endswith(b"data: [DONE]\n\n")
    assert b'"completion_tokens":3' in sent  # what was relayed, counted by the gateway


def _pinging(first: bytes, pings: int) -> StubEngine:
    """A continuation engine that sends ``first`` (b"": nothing), then only a proxy's keep-alive
    comments, ``pings`` of them 0.1 s apart."""

    async def behaviour(_: StubEngine, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if first:
            await response.write(first)
        for _ in range(pings):
            await response.write(b": ping\n\n")
            await asyncio.sleep(0.1)
        await response.write_eof()
        return response

    return StubEngine(behaviour)


def test_keep_alive_comments_do_not_hold_a_continuation_past_its_first_token_limit() -> None:
    """A continuation engine that sends only comments: the first-token limit holds (each comment
    re-armed the idle limit, so the stream and its engine were held as long as they came)."""

    with _pinging(b"", 40) as engine:
        started = time.monotonic()
        outcome, tokens, sent = asyncio.run(_relay_once(engine.url, first_token_s=0.5))
        took = time.monotonic() - started
    assert isinstance(outcome, Cut) and outcome.reason is MigrationReason.STALL, outcome
    assert outcome.error is not None and "no first token" in outcome.error.message
    assert took < 2.5 and sent == b"" and tokens == [7, 8]


def test_keep_alive_comments_after_a_continuation_s_first_token_do_not_hold_it() -> None:
    """Past its first output, every read moved a continuation's idle deadline, a proxy's ping
    too: a continuation engine that stalled behind one held the stream, and its slot, for good."""

    with _pinging(TOKEN, 100) as engine:  # (10 s of pings if nothing ends it)
        started = time.monotonic()
        outcome, tokens, _ = asyncio.run(_relay_once(engine.url, idle_s=0.4))
        took = time.monotonic() - started
    assert isinstance(outcome, Cut) and outcome.reason is MigrationReason.STALL, outcome
    assert took < 3.0 and tokens == [7, 8, 9]


def test_a_restart_on_an_engine_that_parses_reasoning_is_refused_not_emptied() -> None:
    """A restart (nothing relayed yet) re-sends the chat request; an engine with a reasoning
    parser answers in ``reasoning_content``, which the re-shaped events dropped: the client got
    empty content events and no reasoning."""
    first = (
        b'data: {"id":"c","created":0,"model":"m","prompt_token_ids":[1,2],"choices":[{"index":0,'
        b'"delta":{"role":"assistant","reasoning_content":"let me think"},"token_ids":[5]}]}\n\n'
    )
    with _engine(first + b"data: [DONE]\n\n") as engine:
        outcome, tokens, sent = asyncio.run(_relay_once(engine.url, restart=True, kind="chat"))
    assert isinstance(outcome, Cut) and outcome.error is not None
    assert sent == b"" and tokens == []


def test_a_continuation_never_goes_to_an_engine_that_returns_no_token_ids() -> None:
    """A model served by a simulated engine and an OpenAI-compatible one: the continuation's text
    from the latter would reach the client unrecorded, and be repeated after the next cut."""
    flow = _Flow()
    flow.fleet = fleet_of(
        [
            EngineConfig(url="http://127.0.0.1:1", kind="sim", model="m", name="sim-0"),  # type: ignore[arg-type]
            EngineConfig(url="http://127.0.0.1:2", kind="openai", model="m", name="plain-0"),  # type: ignore[arg-type]
            EngineConfig(url="http://127.0.0.1:3", kind="vllm", model="m", name="vllm-0"),  # type: ignore[arg-type]
        ],
        3.0,
    )
    migrator = Migrator(flow)  # type: ignore[arg-type]
    call = _call(_ignore)
    call.engine_id = "sim-0"
    assert migrator._excluded(call, StreamLedger(), []) == ["plain-0", "sim-0"]


@pytest.mark.parametrize(
    ("kind", "forward", "natural"),
    [("vllm", True, None), ("sim", False, 5), ("sim", True, 3)],
    ids=["vllm-ignores-both", "sim-body-only", "sim-body-and-header"],
)
def test_the_sim_s_output_length_controls_count_only_on_a_simulated_engine(
    kind: str, forward: bool, natural: int | None
) -> None:
    """``sim_output_len`` and ``x-sim-output-len`` were read as the answer's length on any engine:
    a vLLM stream that failed past that many tokens was ended as finished ("stop") at once."""
    flow = _Flow()
    config = EngineConfig(url="http://127.0.0.1:1", kind=kind, model="m", name="e0")  # type: ignore[arg-type]
    flow.fleet = fleet_of([config], 3.0)
    flow.fleet.records["e0"].adapter.forwards_sim_headers = forward and kind == "sim"
    call = _call(None, sim_output_len=5)
    call.forward_headers = {"X-Sim-Output-Len": "3"}
    call.engine_id = "e0"
    ledger = StreamLedger()
    ledger.first_chunk = TOKEN.replace(b'"choices"', b'"prompt_token_ids":[1,2],"choices"')
    state = Migrator(flow)._resume_state(call, ledger)  # type: ignore[arg-type]
    assert state is not None and state.natural == natural


def test_a_chat_restart_s_role_announcement_is_relayed_but_no_token() -> None:
    """A restart goes to the chat endpoint, whose stream opens with the role alone: counted as a
    token (the first engine's relay no longer does), the stream's TPOT read one step short."""
    role = (
        b'data: {"id":"x","prompt_token_ids":[1,2,3],"choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    )
    tokens = b"".join(
        b'data: {"id":"x","choices":[{"index":0,"delta":{"content":" t%d"},"token_ids":[%d],'
        b'"finish_reason":null}]}\n\n' % (i, i)
        for i in (9, 10)
    )
    calls: list[Call] = []
    with _engine(role + tokens + b"data: [DONE]\n\n") as engine:
        outcome, ids, sent = asyncio.run(_relay_once(engine.url, restart=True, kind="chat", calls=calls))
    assert outcome == 200 and ids == [9, 10]
    assert sent.count(b"data: {") == 3  # the role event goes out all the same
    assert calls[0].content_events == 2


def test_a_first_event_s_nested_names_are_not_repeated() -> None:
    """The client's chunks repeat the first engine's id, created and model: nested past orjson's
    depth, writing them raised past every handler (the stream dropped, a 500 logged)."""
    deep: object = []
    for _ in range(300):
        deep = [deep]
    shape = _Shape("chat", {"id": deep, "created": 2**70, "model": "m"})
    chunk = orjson.loads(shape.chunk("hi", [1], None, True)[len(b"data: ") :])
    assert chunk["id"] is None and chunk["created"] is None and chunk["model"] == "m"


def test_a_chat_prompt_with_an_image_is_not_migrated() -> None:
    """A continuation sends the prompt as token ids: an image's placeholder tokens, no image
    (vLLM refuses it, or continues without having seen the image)."""
    flow = _Flow()
    migrator = Migrator(flow)  # type: ignore[arg-type]
    record = next(iter(flow.fleet.records.values()))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "what is it"}]}]
    call = _call(_ignore, "chat")
    assert migrator._blocked(call, record) is None
    for messages, blocked in ((with_image, True), (text_only, False)):
        raw = orjson.dumps({"model": "m", "messages": messages, "stream": True})
        call.request = parse_request("chat", raw, 16)
        assert (migrator._blocked(call, record) is not None) is blocked
        assert call.request.summary().media is blocked  # (as a parsing worker sends it back)
