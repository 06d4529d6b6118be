"""Stub engines for fault tests: real servers on 127.0.0.1, each on its own event loop in a thread.

- :class:`StubEngine`: an aiohttp server whose data path (chat, and the Responses API) does whatever
  a *behaviour* says (never answer, send one event then stall, stream events at a pace, answer a
  status after a delay, a Responses API stream that ends one way or another).
- :class:`HeaderEngine`: a stub that keeps every request's headers and answers a short stream or
  a JSON body, optionally held until a gate opens.
- :class:`Blackhole`: an address that answers health checks, then (after :meth:`Blackhole.freeze`)
  accepts no connection at all: its accept queue is full and SYNs are dropped, so connecting hangs.
- :class:`StaleKeepAliveEngine`: keeps every connection open after answering (no
  ``Connection: close``) but closes it, unanswered, when a second request arrives on it: the
  engine closed its idle keep-alive connection just as the gateway reused it.

Every server records what reached it, so tests can check what was (not) sent, and all of them
are context managers that stop everything they started.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import orjson
from aiohttp import web

from tests.gateway.conftest import MODEL
from tests.support.threaded_app import LoopThread, ThreadedApp

MODELS_BODY = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def chunk_event(content: str, index: int = 0) -> bytes:
    """One OpenAI chat-completion chunk as an SSE event."""
    chunk = {
        "id": f"chatcmpl-stub-{index}",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def completion_body(content: str) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


Behaviour = Callable[["StubEngine", web.Request], Awaitable[web.StreamResponse]]


class StubEngine(ThreadedApp):
    """An OpenAI-compatible engine (kind ``openai``: health is ``GET /v1/models``) whose chat route
    runs ``behaviour``. ``received`` holds the JSON body of every data-path request that reached
    it; ``aborted`` counts handlers cut short because the caller closed the connection."""

    thread_name = "stub-engine"
    # handler_cancellation: a closed connection cancels its handler, as a real engine aborts
    runner_options: ClassVar[dict[str, Any]] = {"handler_cancellation": True, "shutdown_timeout": 1.0}

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.received: list[dict[str, Any]] = []
        self.aborted = 0
        self._stopping: asyncio.Event | None = None

    def entry(self, name: str) -> dict[str, object]:
        return {"url": self.url, "kind": "openai", "model": MODEL, "name": name}

    async def wait_forever(self) -> None:
        """What a stuck handler awaits: returns only when the engine stops."""
        assert self._stopping is not None
        await self._stopping.wait()

    async def before_cleanup(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def build(self) -> web.Application:
        self._stopping = asyncio.Event()

        async def chat(request: web.Request) -> web.StreamResponse:
            self.received.append(await request.json())
            try:
                return await self.behaviour(self, request)
            except asyncio.CancelledError:
                self.aborted += 1
                raise

        async def models(_: web.Request) -> web.Response:
            return web.Response(body=MODELS_BODY, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/responses", chat)
        app.router.add_get("/v1/models", models)
        return app


class HeaderEngine(StubEngine):
    """A stub engine that records each data-path request's headers and streams a short answer
    (or answers JSON for a non-streamed request); ``gate`` (when set) holds every answer."""

    def __init__(self, events: int = 3, gate: threading.Event | None = None) -> None:
        super().__init__(self._answer)
        self.headers: list[dict[str, str]] = []
        self.events = events
        self.gate = gate

    async def _answer(self, _: StubEngine, request: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.gate is not None:
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        if not self.received[-1].get("stream"):
            return web.Response(body=completion_body("ok"), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(self.events):
            await response.write(chunk_event(f"t{i} ", i))
            await asyncio.sleep(0.002)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


# -- behaviours ------------------------------------------------------------------------------------


async def never_answer(engine: StubEngine, _: web.Request) -> web.StreamResponse:
    """Accept the request and never send response headers."""
    await engine.wait_forever()
    return web.Response(status=500)


async def one_event_then_stall(engine: StubEngine, request: web.Request) -> web.StreamResponse:
    """Send the SSE headers and one event, then nothing more (the connection stays open)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk_event("first"))
    await engine.wait_forever()
    return response


def events_every(interval_s: float, count: int) -> Behaviour:
    """Stream ``count`` events, one every ``interval_s`` seconds, then ``[DONE]``."""

    async def behaviour(_: StubEngine, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(count):
            if i:
                await asyncio.sleep(interval_s)
            await response.write(chunk_event(f"t{i} ", i))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    return behaviour


def status_after(status: int, delay_s: float) -> Behaviour:
    """Answer ``status`` with an OpenAI-shaped error after ``delay_s`` seconds."""

    async def behaviour(_: StubEngine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay_s)
        error = {"message": f"stub answered {status}", "type": "stub", "param": None, "code": None}
        return web.json_response({"error": error}, status=status)

    return behaviour


# -- an address that stops accepting connections ---------------------------------------------------


class Blackhole:
    """A listening socket that answers health checks (``Connection: close``, so the gateway pools
    nothing) until :meth:`freeze`: then it stops accepting, its backlog drops to 0 and it fills
    its accept queue with connections that are never accepted. Linux drops SYNs to a listener whose accept
    queue is full, so every later connect hangs in SYN-SENT until the connecting side gives up."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        # room for the gateway's first round (health, scrape, models) at once: with no room a
        # SYN is dropped and retried only after a second, past a short connect timeout, and the
        # engine started out unhealthy whenever this thread was slow to accept (a loaded machine)
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._fillers: list[socket.socket] = []
        self._frozen = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="blackhole", daemon=True)

    def entry(self, name: str) -> dict[str, object]:
        return {"url": self.url, "kind": "openai", "model": MODEL, "name": name}

    def __enter__(self) -> Blackhole:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._frozen.set()
        self._thread.join(10)
        for filler in self._fillers:
            filler.close()
        self._listener.close()

    def freeze(self) -> None:
        """Stop accepting, then fill the accept queue until a connect no longer completes."""
        self._frozen.set()
        self._thread.join(10)
        self._listener.listen(0)  # (Linux takes a new backlog on a listening socket)
        for _ in range(16):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", self.port))
            self._fillers.append(filler)
            _, writable, _ = select.select([], [filler], [], 0.2)
            if not writable:
                return  # this SYN was dropped: the queue is full
        raise RuntimeError("could not fill the accept queue")

    def _serve(self) -> None:
        while not self._frozen.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(MODELS_BODY), MODELS_BODY)
                    )


# -- an engine that closes keep-alive connections as they are reused ------------------------------


class StaleKeepAliveEngine:
    """Answers the first request on each connection (HTTP/1.1 keep-alive, no ``Connection:
    close``) and closes the connection, unanswered, when another request arrives on it.

    ``answered`` counts answered requests (health checks included), ``closed_at_reuse`` the
    requests that found their connection closed. A POST with ``"stream": true`` gets an SSE body."""

    def __init__(self) -> None:
        self.url = ""
        self.answered = 0
        self.closed_at_reuse = 0
        self._io = LoopThread("stale-keepalive-engine")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def entry(self, name: str) -> dict[str, object]:
        return {"url": self.url, "kind": "openai", "model": MODEL, "name": name}

    def __enter__(self) -> StaleKeepAliveEngine:
        self._io.start()
        self._io.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._io.run(self._stop())
        self._io.stop()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            served = 0
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = await reader.readexactly(_content_length(head))
                if served:
                    self.closed_at_reuse += 1
                    return  # closed as the request arrived: no answer at all
                served += 1
                self.answered += 1
                writer.write(_answer(head, body))
                await writer.drain()
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _answer(head: bytes, body: bytes) -> bytes:
    if head.startswith(b"GET "):
        content_type, payload = b"application/json", MODELS_BODY
    elif orjson.loads(body).get("stream"):
        content_type = b"text/event-stream"
        payload = chunk_event("hello") + b"data: [DONE]\n\n"
    else:
        content_type, payload = b"application/json", completion_body("hello")
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        content_type,
        len(payload),
        payload,
    )


# -- the Responses API ---------------------------------------------------------------------------------


def response_object(response_id: str, status: str, text: str = "", tokens: int = 0) -> dict[str, Any]:
    """A Responses API ``response`` object as vLLM writes one (the fields the gateway reads)."""
    output = [
        {
            "id": "msg_stub",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    ]
    usage = {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7 + tokens,
    }
    return {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "model": MODEL,
        "status": status,
        "error": None,
        "output": output if status != "in_progress" else [],
        "usage": usage if status != "in_progress" else None,
    }


def response_event(kind: str, sequence: int, **fields: Any) -> bytes:
    data = {**fields, "sequence_number": sequence, "type": kind}
    return f"event: {kind}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"


def responses_stream(
    deltas: int, end: str = "completed", gap_s: float = 0.002, ping: bool = False
) -> Behaviour:
    """A Responses API stream as vLLM sends one: created, in progress, an output item opened,
    ``deltas`` text deltas ``gap_s`` apart, then by ``end``: ``completed`` (the item closed and
    ``response.completed`` with usage), ``error`` (an error event, then the stream ends),
    ``stall`` (nothing more, the connection held) or ``cut`` (the connection closed without an
    end); ``ping``: a keep-alive comment after the first event."""

    async def behaviour(engine: StubEngine, request: web.Request) -> web.StreamResponse:
        rid = "resp_stub1"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        seq = 0

        async def emit(kind: str, **fields: Any) -> None:
            nonlocal seq
            await response.write(response_event(kind, seq, **fields))
            seq += 1

        opened = response_object(rid, "in_progress")
        await emit("response.created", response=opened)
        if ping:
            await response.write(b": ping\n\n")  # (a keep-alive comment: no event, nor numbered)
        await emit("response.in_progress", response=opened)
        item = {
            "id": "msg_stub",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        await emit("response.output_item.added", item=item, output_index=0)
        part = {"type": "output_text", "text": "", "annotations": []}
        await emit(
            "response.content_part.added", part=part, item_id="msg_stub", output_index=0, content_index=0
        )
        text = ""
        for i in range(deltas):
            await asyncio.sleep(gap_s)
            # (a delta whose text names the events that end a stream is still text)
            delta = f'w{i} "response.completed" "error" .delta" '
            text += delta
            await emit(
                "response.output_text.delta",
                delta=delta,
                item_id="msg_stub",
                output_index=0,
                content_index=0,
                logprobs=[],
            )
        if end == "error":
            await emit("error", code="InternalServerError", message="stub failed mid-stream", param=None)
        elif end == "stall":
            await engine.wait_forever()
        elif end == "completed":
            await emit(
                "response.output_text.done", text=text, item_id="msg_stub", output_index=0, content_index=0
            )
            await emit("response.completed", response=response_object(rid, "completed", text, deltas))
        await response.write_eof()
        return response

    return behaviour
