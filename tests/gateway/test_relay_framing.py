"""The SSE relay against an engine's bytes cut at every awkward place: events split across reads
(down to one byte), CRLF event endings, content sharing a read with [DONE]."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterable
from typing import Any, cast

import aiohttp
import orjson
import pytest

from gateway.api.request_parse import parse_request
from gateway.dispatch.offline import offline_fleet
from gateway.fleet.registry import EngineRecord, RunningEntry
from gateway.serving.call import Call
from gateway.serving.relay import MAX_EVENT_BYTES, relay_stream, upstream_error
from gateway.serving.stream_state import Cut, StreamLedger
from gateway.sse import SseFramer
from policies.migration import MigrationReason
from policies.slo import SloSource, SloTarget

TARGET = SloTarget(ttft_s=10.0, tpot_s=1.0, slo_class="c", source=SloSource.TASK)


def event(data: dict[str, Any] | str, sep: bytes = b"\n\n") -> bytes:
    body = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + body + sep


def content(text: str, sep: bytes = b"\n\n") -> bytes:
    return event({"choices": [{"index": 0, "delta": {"content": text}}], "usage": None}, sep)


def usage(sep: bytes = b"\n\n") -> bytes:
    return event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, sep)


class _Content:
    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = list(chunks)

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


class _Response:
    status = 200

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.content = _Content(chunks)


async def relay_on(
    chunks: list[bytes],
    ledger: StreamLedger | None = None,
    wants_usage: bool = False,
    prompt: str = "hi",
    reader: _Content | None = None,
    first_token_at: float = 1e12,
    idle_s: float = 30.0,
) -> tuple[int | Cut, bytes, Call, EngineRecord]:
    """Relay ``chunks`` (an engine's reads; or what ``reader`` reads) for one stream; what the
    client got, and the engine."""
    body: dict[str, Any] = {"model": "a", "prompt": prompt, "stream": True}
    if wants_usage:
        body["stream_options"] = {"include_usage": True}
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    fleet = offline_fleet({"a": 1})
    record = fleet.records["a-0"]
    entry = RunningEntry(3, 16, 1.0, 0.0)
    fleet.reserve("a-0", "sg-1", entry)
    call = Call(
        parse_request("completions", orjson.dumps(body), 16), "sg-1", "c", 0.0, send, TARGET, None, (), {}
    )
    call.engine_id, call.entry = "a-0", entry
    response = _Response(chunks)
    if reader is not None:
        response.content = reader
    outcome = await relay_stream(
        call, cast(aiohttp.ClientResponse, response), fleet, record, first_token_at, idle_s, ledger
    )
    return outcome, b"".join(sent), call, record


async def relay(chunks: list[bytes], wants_usage: bool = False) -> tuple[int, bytes, Call]:
    status, sent, call, record = await relay_on(chunks, wants_usage=wants_usage)
    assert isinstance(status, int)
    assert record.in_flight == 0  # released once the engine's part was over
    return status, sent, call


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
async def test_events_split_anywhere_are_relayed_whole_and_counted_once(sep: bytes) -> None:
    stream = content("a", sep) + content("b", sep) + usage(sep) + b"data: [DONE]" + sep
    for cut in range(1, len(stream)):
        for size in (1, 2, 7):
            pieces = [stream[:cut]] + [stream[i : i + size] for i in range(cut, len(stream), size)]
            status, out, call = await relay(pieces)
            assert status == 200, (cut, size)
            # the usage-only chunk the gateway asked for is dropped; everything else untouched
            assert out == content("a", sep) + content("b", sep) + b"data: [DONE]" + sep, (cut, size)
            assert call.content_events == 2 and call.completion_tokens == 2, (cut, size)


async def test_content_sharing_a_read_with_done_is_counted() -> None:
    status, out, call = await relay(
        [content("a") + content("b") + usage() + b"data: [DONE]\n\n"], wants_usage=True
    )
    assert status == 200 and out.count(b"data: ") == 4  # the client asked for usage: it is kept
    assert call.content_events == 2 and call.entry is not None and call.entry.generated == 2


ENGINE_ERROR = (
    b'data: {"error":{"object":"error","message":"EngineCore encountered an issue","code":500}}\n\n'
)
TOKEN_EVENT = (
    b'data: {"id":"c1","created":1,"model":"a","choices":[{"index":0,"text":"x","token_ids":[5],'
    b'"prompt_token_ids":[1,2],"finish_reason":null}]}\n\n'
)


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "two-reads"])
async def test_an_error_event_in_band_is_a_failure_not_a_finished_stream(together: bool) -> None:
    """vLLM reports a failure mid-stream as an error event, then [DONE]: relayed as a finished
    200 stream, it was counted as served and never migrated."""
    chunks = (
        [TOKEN_EVENT + ENGINE_ERROR + b"data: [DONE]\n\n"]
        if together
        else [
            TOKEN_EVENT,
            ENGINE_ERROR + b"data: [DONE]\n\n",
        ]
    )
    status, sent, call = await relay(chunks)
    assert status == 502 and ENGINE_ERROR in sent and sent.endswith(b"data: [DONE]\n\n")
    assert call.content_events == 1  # (the error is no content)

    # a stream that may migrate: what came before the error goes out, then it is cut
    ledger = StreamLedger()
    outcome, sent, _, _ = await relay_on(chunks, ledger)
    assert isinstance(outcome, Cut) and outcome.error is not None and outcome.error.status == 502
    assert ledger.tokens() == [5] and sent == TOKEN_EVENT


async def test_ending_a_stream_with_an_error_stops_watching_for_the_clients_disconnect() -> None:
    """The server reports a disconnect once a response is complete: still watched after the
    error event went out, the handler's clean-up was cancelled and the request counted as the
    client's disconnect (499) instead of the engine's 502/504."""
    import asyncio

    from gateway.api.errors import GatewayError
    from gateway.serving.relay import end_with_error

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    body = {"model": "a", "prompt": "hi", "stream": True}
    call = Call(
        parse_request("completions", orjson.dumps(body), 16), "sg-3", "c", 0.0, send, TARGET, None, (), {}
    )
    call.watcher = asyncio.create_task(asyncio.sleep(30, result=True))
    await end_with_error(call, GatewayError(504, "stalled", code="upstream_timeout"))
    await asyncio.sleep(0)
    assert call.watcher.cancelled()
    assert sent[-1]["more_body"] is False and sent[-1]["body"].endswith(b"data: [DONE]\n\n")


async def test_a_finished_streams_usage_teaches_its_engine_how_many_tokens_an_event_carries() -> None:
    six = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}})
    status, _, _, record = await relay_on([content("abc") + content("def") + six + b"data: [DONE]\n\n"])
    assert status == 200
    assert record.tokens_per_event == pytest.approx(1.0 + 0.2 * (3.0 - 1.0))


async def test_an_error_before_the_first_token_leaves_the_stream_free_to_restart() -> None:
    """An error event as a stream's first event was taken as its first token, and the empty
    chunk before it as the ledger's first event: the stream could not restart elsewhere."""
    ledger = StreamLedger()
    outcome, sent, call, _ = await relay_on([ENGINE_ERROR + b"data: [DONE]\n\n"], ledger)
    assert isinstance(outcome, Cut) and outcome.error is not None
    assert "EngineCore encountered an issue" in outcome.error.message  # the engine's own words
    assert ledger.first_chunk is None and not call.first_at and sent == b""


async def test_an_error_response_of_the_older_shape_is_a_failure_too() -> None:
    older = b'data: {"object": "error", "message": "out of memory", "type": "InternalServerError", "code": 500}\n\n'
    outcome, sent, _, _ = await relay_on([TOKEN_EVENT, older + b"data: [DONE]\n\n"], StreamLedger())
    assert isinstance(outcome, Cut) and outcome.error is not None and "out of memory" in outcome.error.message
    assert sent == TOKEN_EVENT


async def test_an_error_event_then_a_close_without_done_ends_with_one_error() -> None:
    """Without [DONE] after its error event, the stream got a second error event of the gateway's."""
    status, sent, _ = await relay([TOKEN_EVENT, ENGINE_ERROR])
    assert status == 502 and sent.count(b'data: {"error"') == 1 and sent.endswith(b"data: [DONE]\n\n")


# -- what servers other than vLLM write ------------------------------------------------------------


def tight(data: dict[str, Any] | str) -> bytes:
    """An event as ``data:{...}``: no space after the colon, as the SSE spec allows."""
    return b"data:" + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


async def test_events_without_the_optional_space_are_read_as_events() -> None:
    """``data:{...}`` is as valid SSE as ``data: {...}``: read as plain bytes, its [DONE] was
    missed (the stream ended with a gateway error event after the answer), its usage-only chunk
    relayed though the client had not asked, its usage never read."""
    text = tight({"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": None})
    tail = tight({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    status, out, call = await relay([text + tail + tight("[DONE]")])
    assert status == 200
    assert out == text + tight("[DONE]")  # untouched, less the usage chunk nobody asked for
    assert b'"error"' not in out
    assert call.content_events == 1 and call.completion_tokens == 2


async def test_an_error_event_without_the_space_is_a_failure() -> None:
    error = tight({"error": {"message": "engine fell over", "type": "InternalServerError", "code": 500}})
    outcome, sent, _, _ = await relay_on([TOKEN_EVENT, error + tight("[DONE]")], StreamLedger())
    assert isinstance(outcome, Cut) and outcome.error is not None
    assert "engine fell over" in outcome.error.message
    assert sent == TOKEN_EVENT


async def test_running_usage_in_every_chunk_is_counted_once_with_its_final_totals() -> None:
    """``stream_options.continuous_usage_stats``: vLLM repeats the running totals in every chunk.
    Each was added to the token counters, so a stream of n tokens counted its prompt n + 1 times."""
    from gateway import metrics
    from gateway.serving.relay import count_usage

    def running(text: str, done: int) -> bytes:
        return event(
            {
                "choices": [{"index": 0, "delta": {"content": text}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": done, "total_tokens": 3 + done},
            }
        )

    def counted(kind: str) -> float:
        metrics.flush_deferred()  # (as a collection does)
        return float(metrics.child(metrics.TOKENS, "a", kind)._value.get())

    before = counted("prompt"), counted("completion")
    final = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    stream = running("a", 1) + running("b", 2) + running("c", 3) + running("d", 4) + final
    status, _, call = await relay([stream + b"data: [DONE]\n\n"])
    assert status == 200 and call.completion_tokens == 4 and call.content_events == 4
    assert (counted("prompt"), counted("completion")) == before  # nothing counted mid-stream
    count_usage(call)
    count_usage(call)  # (once per request, however often it is asked)
    assert (counted("prompt") - before[0], counted("completion") - before[1]) == (3, 4)


async def test_a_stream_of_several_choices_counts_each_choices_events() -> None:
    """``n`` choices: an event per running choice at each step; the longest choice's events are
    the steps its TPOT is judged over (a choice that ended sends no more)."""

    def choice(index: int, text: str) -> bytes:
        return event({"choices": [{"index": index, "text": text}], "usage": None})

    body = orjson.dumps({"model": "a", "prompt": "hi", "stream": True, "n": 2})
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    fleet = offline_fleet({"a": 1})
    entry = RunningEntry(3, 16, 1.0, 0.0)
    fleet.reserve("a-0", "sg-1", entry)
    call = Call(parse_request("completions", body, 16), "sg-1", "c", 0.0, send, TARGET, None, (), {})
    call.engine_id, call.entry = "a-0", entry
    steps = [choice(0, "a") + choice(1, "b")] * 2 + [choice(1, "c")] * 3  # choice 0 ends after 2
    response = cast(aiohttp.ClientResponse, _Response([*steps, b"data: [DONE]\n\n"]))
    status = await relay_stream(call, response, fleet, fleet.records["a-0"], 1e12, 30.0, None)
    assert status == 200 and call.content_events == 7
    assert call.choice_events == {0: 2, 1: 5}


async def test_nothing_an_engine_sends_after_done_reaches_the_client() -> None:
    """Content after [DONE] in the same read went out after the end-of-stream marker and was
    counted as output."""
    late = content("late")
    status, out, call = await relay([content("a") + b"data: [DONE]\n\n" + late])
    assert status == 200 and out == content("a") + b"data: [DONE]\n\n"
    assert call.content_events == 1


async def test_keep_alive_comments_are_relayed_but_are_no_output_and_no_first_token() -> None:
    """A proxy's ``: ping`` between events was counted as an output event, and one before the
    first token was taken as the first token (TTFT met by a comment)."""
    ping = b": ping\n\n"
    _, _, call, _ = await relay_on([ping])  # (ends without [DONE]: a failure)
    assert not call.first_at and call.content_events == 0
    status, out, call = await relay([ping, content("a") + ping, content("b") + b"data: [DONE]\n\n"])
    assert status == 200 and out == ping + content("a") + ping + content("b") + b"data: [DONE]\n\n"
    assert call.content_events == 2 and call.first_at


def spaced(data: dict[str, Any] | str) -> bytes:
    """An event whose JSON has a space after every colon and comma, as Python's json.dumps
    writes it: valid JSON that a byte search for ``"key":`` misses."""
    import json

    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


async def test_usage_of_json_written_with_spaces_is_read() -> None:
    text = spaced({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    tail = spaced({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    status, out, call = await relay([text + tail + b"data: [DONE]\n\n"])
    assert status == 200 and out == text + b"data: [DONE]\n\n"  # (the client did not ask for usage)
    assert call.completion_tokens == 1 and call.content_events == 1


async def test_a_ledger_reads_token_ids_and_the_end_of_json_written_with_spaces() -> None:
    """Written with spaces, the ids of a stream that may migrate were not recorded: resumed on
    another engine, it repeated every token the client already had."""
    first = {"id": "c1", "created": 1, "model": "a", "prompt_token_ids": [1, 2]}
    tokens = [
        spaced({**first, "choices": [{"index": 0, "text": "x", "token_ids": [5, 6], "finish_reason": None}]}),
        spaced({"choices": [{"index": 0, "text": "y", "token_ids": [7], "finish_reason": None}]}),
    ]
    ledger = StreamLedger()
    outcome, sent, _, _ = await relay_on([*tokens, ENGINE_ERROR], ledger)
    assert isinstance(outcome, Cut) and sent == b"".join(tokens)
    assert ledger.tokens() == [5, 6, 7] and not ledger.finished
    end = spaced({"choices": [{"index": 0, "text": "", "token_ids": [8], "finish_reason": "stop"}]})
    ledger = StreamLedger()
    outcome, _, _, _ = await relay_on([*tokens, end, ENGINE_ERROR], ledger)
    assert ledger.tokens() == [5, 6, 7, 8] and ledger.finished


async def test_a_comment_before_the_first_event_leaves_the_stream_resumable() -> None:
    ledger = StreamLedger()
    outcome, _, _, _ = await relay_on([b": ping\n\n", TOKEN_EVENT, ENGINE_ERROR], ledger)
    assert isinstance(outcome, Cut) and ledger.tokens() == [5]
    first = ledger.first_event()
    assert first is not None and first["id"] == "c1"


async def test_an_error_after_a_comment_is_no_first_token_and_comments_mixed_with_data_are_read() -> None:
    """An error event sharing a read with a comment before it was taken as the first token; an
    event whose data follows a comment line (``: ping\\ndata: ...``) was relayed as content: an
    error in it went unseen, a [DONE] in it was missed (a gateway error event followed)."""
    ping = b": ping\n\n"
    ledger = StreamLedger()
    outcome, _, call, _ = await relay_on([ping + ENGINE_ERROR], ledger)
    assert isinstance(outcome, Cut) and not call.first_at
    mixed_error = b": ping\n" + ENGINE_ERROR
    outcome, sent, call, _ = await relay_on([TOKEN_EVENT, mixed_error], StreamLedger())
    # (relayed as content, the error went out and the stream then ended incomplete: a Cut too)
    assert isinstance(outcome, Cut) and outcome.error is not None and sent == TOKEN_EVENT
    assert "EngineCore encountered an issue" in outcome.error.message
    status, out, call = await relay([content("a"), b": ping\ndata: [DONE]\n\n"])
    assert status == 200 and b'"error"' not in out and call.content_events == 1


async def test_a_comment_before_the_first_token_leaves_the_first_token_limit_in_force() -> None:
    """Every chunk moved the deadline to the idle limit: a ping before the first token cut the
    first-token limit down to the idle limit."""
    import asyncio

    class Paced(_Content):
        async def readany(self) -> bytes:
            chunk = await super().readany()
            if chunk == TOKEN_EVENT:
                await asyncio.sleep(0.3)  # past the idle limit, within the first-token limit
            return chunk

    reader = Paced([b": ping\n\n", TOKEN_EVENT, b"data: [DONE]\n\n"])
    first_token_at = asyncio.get_running_loop().time() + 2.0
    outcome, sent, _, _ = await relay_on([], reader=reader, first_token_at=first_token_at, idle_s=0.1)
    assert outcome == 200 and sent.endswith(b"data: [DONE]\n\n")


async def test_a_stream_whose_spaced_json_carries_reasoning_is_not_resumable() -> None:
    """Resumed as plain completions, reasoning or tool calls would come back as text: the byte
    search that blocks such streams missed them in JSON written with spaces."""
    first = {"id": "c1", "created": 1, "model": "a", "prompt_token_ids": [1, 2]}
    delta = {"index": 0, "delta": {"reasoning_content": "hmm"}, "token_ids": [5], "finish_reason": None}
    ledger = StreamLedger()
    await relay_on([spaced({**first, "choices": [delta]}), ENGINE_ERROR], ledger)
    assert ledger.blocked and not ledger.tracking


async def test_output_after_an_in_band_error_is_not_counted() -> None:
    """Events an engine sends after its error event: a migrating stream relays only what came
    before the error, yet counted them all, as output and in its ledger's pace."""
    chunk = TOKEN_EVENT + ENGINE_ERROR + TOKEN_EVENT.replace(b"[5]", b"[6]") + b"data: [DONE]\n\n"
    ledger = StreamLedger()
    outcome, sent, call, _ = await relay_on([chunk], ledger)
    assert isinstance(outcome, Cut) and sent == TOKEN_EVENT
    assert call.content_events == 1 and ledger.tokens() == [5]
    assert call.entry is not None and call.entry.generated == 1


def test_an_event_arriving_over_many_reads_is_held_in_about_its_own_size() -> None:
    """A long event in many reads: each read was joined to everything before it and the whole
    rescanned (a 4 MB event in 4 KB reads: a thousand copies and scans); held as a list of the
    reads instead, an engine writing two bytes at a time cost some 20 times the event."""
    framer = SseFramer(MAX_EVENT_BYTES)
    event = b"data: {" + b"x" * 199_990 + b"}\n"
    assert framer.feed(event[:7]) == b""
    tracemalloc.start()
    try:
        for at in range(7, len(event), 2):
            assert framer.feed(event[at : at + 2]) == b""
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(event)  # (a growing buffer reallocates: briefly two copies)
    # the boundary's second byte in the next read, with the start of the next event
    assert framer.feed(b"\ndata: 2") == event + b"\n"
    assert framer.held == b"data: 2"
    assert framer.feed(b"\r\n\r\n") == b"data: 2\r\n\r\n" and framer.sep == b"\r\n\r\n"


def test_a_crlf_boundary_after_lf_events_in_one_read_is_not_left_waiting() -> None:
    """LF events, then one ended CRLF CRLF (a proxy's keep-alive) and the start of another, in
    one read: the rest after the last LF boundary was never searched again, so the CRLF event
    waited for a later boundary instead of going out."""
    framer = SseFramer(MAX_EVENT_BYTES)
    assert framer.feed(b"data: a\n\ndata: b\r\n\r\nda") == b"data: a\n\ndata: b\r\n\r\n"
    assert framer.sep == b"\r\n\r\n" and framer.held == b"da"
    assert framer.feed(b"ta: c\r\n\r\n") == b"data: c\r\n\r\n"


async def test_an_event_past_the_limit_ends_the_stream_with_an_error_event() -> None:
    reads = [content("a"), b"data: {" + b"x" * 65536] + [b"x" * 65536] * (MAX_EVENT_BYTES // 65536)
    status, out, _, _ = await relay_on(reads)  # (the caller releases the engine after a failure)
    assert status == 502
    assert out.startswith(content("a")) and b"oversized event" in out and out.endswith(b"data: [DONE]\n\n")


async def test_a_first_event_echoing_a_long_prompts_token_ids_is_relayed() -> None:
    """A stream that may migrate asks for token ids, and the engine's first event then echoes
    the prompt's: about 4.9 MB for a 700k-token prompt. The stream failed with an "oversized
    event" where it succeeds with migration off."""
    prompt_ids = orjson.dumps(list(range(100_000, 100_000 + 700_000)))
    first = (
        b'data: {"id":"c","created":0,"model":"a","prompt_token_ids":' + prompt_ids + b',"choices":'
        b'[{"index":0,"text":" a","token_ids":[5],"finish_reason":null}],"usage":null}\n\n'
    )
    assert len(first) > MAX_EVENT_BYTES
    reads = [first[i : i + 65536] for i in range(0, len(first), 65536)]
    reads += [content("b"), usage(), b"data: [DONE]\n\n"]
    ledger = StreamLedger()
    status, out, call, _ = await relay_on(reads, ledger, prompt="hello " * 700_000)
    assert status == 200 and out == first + content("b") + b"data: [DONE]\n\n"
    assert call.content_events == 2 and ledger.tokens() == [5]


async def test_a_usage_chunk_after_an_error_event_is_not_taken_as_told() -> None:
    """Finish, an error event, then the usage-only chunk, in one read: nothing after the error
    is relayed, yet the usage was taken as told, and a stream cut there ended without the usage
    chunk the client asked for."""
    finish = event({"choices": [{"index": 0, "text": "a", "token_ids": [4], "finish_reason": "stop"}]})
    failure = event({"error": {"message": "engine died", "code": 500}})
    outcome, out, call, _ = await relay_on([finish + failure + usage()], StreamLedger(), wants_usage=True)
    assert isinstance(outcome, Cut) and out == finish
    assert not call.usage_told
    _, _, told, _ = await relay_on([finish + usage()], StreamLedger(), wants_usage=True)
    assert told.usage_told  # (the usage chunk with nothing before it failing: told)


async def test_keep_alive_comments_after_the_first_token_do_not_hold_a_stalled_stream() -> None:
    """After the first token every chunk moved the idle deadline, a proxy's ``: ping`` too: an
    engine that stalled behind a proxy pinging every 15 s (idle limit 30 s) held the stream, and
    its engine's slot, for as long as the pings came."""
    import asyncio

    class Pinging(_Content):
        async def readany(self) -> bytes:
            if self._chunks:
                return await super().readany()
            await asyncio.sleep(0.03)
            return b": ping\n\n"  # the engine stalled; its proxy pings on

    outcome, sent, _, _ = await asyncio.wait_for(relay_on([], reader=Pinging([TOKEN_EVENT]), idle_s=0.2), 5.0)
    assert outcome == 504
    assert b"stalled between events" in sent


async def test_an_lf_comment_inside_a_crlf_stream_does_not_hide_its_done() -> None:
    """An engine ending its events CRLF CRLF and a proxy pinging with LF ones: the ping was held
    (only CRLF boundaries were sought once they were seen) and joined to the next event, whose
    ``[DONE]`` was then not found behind the ping and its blank line: a finished stream ended
    with an error event."""
    crlf = b"\r\n\r\n"
    status, out, call = await relay(
        [content("a", crlf), b": ping\n\n", content("b", crlf) + b"data: [DONE]" + crlf]
    )
    assert status == 200 and b"error" not in out, out
    assert out.endswith(b"data: [DONE]" + crlf) and call.content_events == 2
    status, out, call = await relay([content("a", crlf), b": ping\n\n", b"data: [DONE]" + crlf])
    assert status == 200 and b"error" not in out and call.content_events == 1, out


def role_only(index: int = 0) -> bytes:
    """The event vLLM opens a chat stream with: the role, no token."""
    return event(
        {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]}
    )


@pytest.mark.parametrize("together", [False, True])
async def test_the_role_announcement_opening_a_chat_stream_is_no_token(together: bool) -> None:
    """Counted as a content event, it made every vLLM chat stream one step longer than it was:
    TPOT judged at (N - 1) / N of the real one (half of it for two tokens), and the stream's
    first token timed at an event that carried none."""
    tokens = content("a") + content("b") + content("c") + b"data: [DONE]\n\n"
    chunks = [role_only() + tokens] if together else [role_only(), tokens]
    status, out, call = await relay(chunks)
    assert status == 200 and out == role_only() + tokens  # relayed untouched all the same
    assert call.content_events == 3 and call.entry is not None and call.entry.generated == 3
    # a delta with the role and content (the simulated engine's first event) is a token
    status, _, call = await relay(
        [event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}), tokens]
    )
    assert status == 200 and call.content_events == 4


async def test_an_error_event_with_a_deeply_nested_message_is_a_failure_not_a_crash() -> None:
    """str() of a message nested past the recursion limit raised past the relay's handlers."""
    nested = b"[" * 1000 + b"]" * 1000
    event = b'data: {"error":{"message":' + nested + b',"code":500}}\n\n'
    outcome, sent, _, _ = await relay_on([TOKEN_EVENT, event + b"data: [DONE]\n\n"], StreamLedger())
    assert isinstance(outcome, Cut) and outcome.error is not None and sent == TOKEN_EVENT
    assert len(outcome.error.message) < 1000


def test_an_error_response_with_a_deeply_nested_message_keeps_its_status() -> None:
    nested = b"[" * 1000 + b"]" * 1000
    error = upstream_error(503, b'{"error":{"message":' + nested + b',"code":"busy"}}')
    assert error.status == 503 and error.code == "busy" and len(error.message) <= 2000


@pytest.mark.parametrize(
    ("event", "said"),
    [
        (
            b'error: {"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}',
            "the request exceeds the available context size",
        ),
        (b"error: engine on fire", "engine on fire"),
        (b'error: {"message":' + b"[" * 300 + b"]" * 300 + b"}", None),  # (not JSON the gateway writes again)
    ],
)
async def test_an_error_field_as_llama_server_sends_it_is_an_error_the_client_reads(
    event: bytes, said: str | None
) -> None:
    """llama-server builds of 2024-25 end a failed stream with an ``error:`` field, then [DONE]:
    relayed as it was, clients ignored the unknown field (an empty completion, the engine's
    message lost) and the gateway counted it as output and served (200)."""
    status, sent, call = await relay([TOKEN_EVENT, event + b"\n\ndata: [DONE]\n\n"])
    assert status == 502 and call.content_events == 1
    assert b"\nerror:" not in sent and not sent.startswith(b"error:")
    (relayed,) = [line for line in sent.split(b"\n\n") if b'"error"' in line]
    error = orjson.loads(relayed.removeprefix(b"data: "))["error"]
    assert said is None or error["message"] == said
    assert isinstance(error["message"], str) and sent.endswith(b"data: [DONE]\n\n")


ABORT_EVENT = (
    b'data: {"id":"c1","created":1,"model":"a","choices":[{"index":0,"text":"","token_ids":[],'
    b'"finish_reason":"abort"}]}\n\n'
)


async def test_a_choice_the_engine_aborted_is_a_failure_not_a_finished_answer() -> None:
    """An engine aborting its requests (its own pause or abort, a sleep with mode=abort) ends a
    stream with finish_reason "abort": taken for the end, the client got a truncated answer as a
    whole one (counted as served) and a migratable stream was never resumed."""
    chunks = [TOKEN_EVENT, ABORT_EVENT + b"data: [DONE]\n\n"]
    status, sent, call = await relay(chunks)
    assert status == 502 and call.content_events == 1
    ledger = StreamLedger()
    outcome, sent, _, _ = await relay_on(chunks, ledger)
    assert isinstance(outcome, Cut) and outcome.reason is MigrationReason.FAILURE
    assert sent == TOKEN_EVENT and ledger.tokens() == [5] and not ledger.finished
