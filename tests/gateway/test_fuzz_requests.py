"""Bad input never gets a 500: fuzzed request headers and bodies against a real gateway.

Two ways in. Most requests are handed to the gateway's ASGI app directly (its lifespan driven as a
server would), so header names and values can be any bytes, including ones an HTTP server refuses
before the app sees them. A few hundred more go through a real uvicorn server (httptools) over raw
sockets, with whatever HTTP/1.1 lets through (obs-text bytes 0x80-0xff in values included).

Behind every gateway: a zero-latency simulated engine (model ``m``), a recording engine (model
``rec``, kind vllm with priority scheduling) that checks every ``priority`` the gateway writes into
a body is an integer any JSON parser reads exactly, and a model whose only engine is down
(``down``). One ASGI gateway needs API keys, the other is open and relays ``x-sim-*`` headers to
the simulated engine.

Every answer is checked:

* never a 500, and nothing escapes the app; ASGI messages in order (one start, then bodies, the
  last one final), header names lower-case and no value that could split a header;
* an error is OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``) whose
  ``type`` matches its status; a 401 carries a Bearer challenge, a data-path 429/503 a Retry-After;
* the status is the one the input calls for whenever the generator knows it: 401 for a missing
  or wrong key, 403 for an admin key, 405, 413, 400 for a malformed body or SLO header, 404 for an
  unknown model, 503 for a model without a healthy engine, 200 for a valid request;
* a 200 is a valid completion / embeddings JSON, or an SSE stream of JSON chunks ending in
  ``data: [DONE]`` with the usage chunk only when the client asked for it, and it carries the
  client's ``X-Request-Id`` (when that is a sane one) and the SLO headers.

Requests per run: 1,800 generated ASGI requests and 300 over HTTP (2,100 in all), plus the past
defects pinned as fixed cases (104 ASGI, 13 HTTP). The whole file takes about 20 s. ``--hypothesis-show-statistics``
shows the statuses seen and how many the generator predicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import time
from collections.abc import Callable, Coroutine, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from gateway.api.request_parse import RouteKind
from gateway.app import FrontDoor, create_app
from gateway.dispatch.slo_service import MAX_TARGET_MS
from gateway.engines.base import PRIORITY_EPOCH_S
from gateway.procs import ChildProcess, spawn_sim_engine
from gateway.settings import Settings, load_settings
from tests.gateway.gateway_thread import RunningGateway, run_gateway
from tests.support.threaded_app import LoopThread, ThreadedApp

T = TypeVar("T")
Verdict = Literal["ok", "bad", "any"]
Headers = list[tuple[bytes, bytes]]
Message = MutableMapping[str, Any]

MODEL = "m"  # served by the simulated engine
REC = "rec"  # served by the recording engine
DOWN = "down"  # served only by an engine that is not running
CLIENT_KEY = "sk-fuzz-client-0123456789"
POLICY_KEY = "sk-fuzz-policy-0123456789"
ADMIN_KEY = "sk-fuzz-admin-0123456789"
MAX_BODY = 64 * 1024
#: what the gateway promises about the ``priority`` it writes for an engine: an exact JSON integer
ENGINE_PRIORITY_LIMIT = (1 << 53) - 1
DATA_PATHS: dict[str, RouteKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
OTHER_PATHS = ("/v1/models", "/health", "/ready", "/metrics", "/admin/engines", "/nope", "/v1/nope", "/")
#: the statuses the data path may answer with (its own, and engines' relayed ones)
DATA_STATUSES = frozenset({200, 400, 401, 403, 404, 405, 413, 429, 502, 503, 504})
#: the error ``type`` for each status (gateway/api/errors.py; relayed engine errors included)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_CLIENT_ID = re.compile(rb"[\x21-\x7e]{1,128}")
_VISIBLE = re.compile(r"[\x20-\x7e]*")
_BAD_HEADER_VALUE = re.compile(rb"[\x00\r\n]")
_SIM_FAULTS = (b"hang", b"crash-after", b"slow")  # would hang or kill the shared engine
_TIMEOUT_S = 20.0


# -- the engines -------------------------------------------------------------------------------


class RecordingEngine(ThreadedApp):
    """A fast OpenAI-compatible engine in a thread: answers 200 with a valid body or SSE stream,
    and records what the gateway sent. A ``priority`` that is not an exact JSON integer is refused
    with a 400 (as a strict engine would) and noted in :attr:`violations`, as is any header the
    gateway must not relay to a vLLM engine."""

    thread_name = "fuzz-recorder"

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.violations: list[str] = []

    def take(self) -> tuple[list[tuple[dict[str, str], dict[str, Any]]], list[str]]:
        received, violations = self.received, self.violations
        self.received, self.violations = [], []
        return received, violations

    def _check(self, headers: dict[str, str], body: Any) -> str | None:
        if not isinstance(body, dict):
            return f"body is not a JSON object: {body!r:.100}"
        priority = body.get("priority")
        if type(priority) is not int or abs(priority) > ENGINE_PRIORITY_LIMIT:
            return f"priority must be an integer within +-(2**53-1), got {priority!r}"
        for name, value in headers.items():
            if name == "authorization" or name.startswith("x-sim-"):
                return f"header {name} must not reach a vllm engine without an api_key"
            if name in ("traceparent", "tracestate") and not _VISIBLE.fullmatch(value):
                return f"header {name} is not visible ASCII: {value!r}"
        return None

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        raw = await request.read()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw
        self.received.append((headers, body if isinstance(body, dict) else {}))
        problem = self._check(headers, body)
        if problem is not None:
            self.violations.append(problem)
            error = {"message": problem, "type": "BadRequestError", "param": "priority", "code": 400}
            return web.json_response({"error": error}, status=400)
        assert isinstance(body, dict)
        model = str(body.get("model"))
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if request.path == "/v1/embeddings":
            data = [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}]
            return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})
        chat = request.path == "/v1/chat/completions"
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "ok"}
            else:
                choice["text"] = "ok"
            full = {"id": "rec-1", "object": obj, "created": 1, "model": model, "choices": [choice]}
            return web.json_response({**full, "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        for text, finish in (("o", None), ("k", "stop")):
            delta: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                delta["delta"] = {"content": text}
            else:
                delta["text"] = text
            event = {"id": "rec-1", "object": chunk_obj, "created": 1, "model": model, "choices": [delta]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            event = {"id": "rec-1", "object": chunk_obj, "created": 1, "model": model, "choices": []}
            await response.write(b"data: " + orjson.dumps({**event, "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def build(self) -> web.Application:
        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application(client_max_size=4 * MAX_BODY)
        for path in DATA_PATHS:
            app.router.add_post(path, self._serve)
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", ok)
        return app


@contextlib.contextmanager
def dead_engine_url() -> Iterator[str]:
    """A URL that refuses connections for as long as the context lasts: its port is bound and
    never listened on, so nothing else can take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def fuzz_settings(
    sim: ChildProcess, recorder: RecordingEngine, dead_url: str, **overrides: Any
) -> dict[str, Any]:
    engines = [
        {"url": sim.url, "kind": "sim", "model": MODEL, "name": "sim", "priority_scheduling": True},
        {"url": recorder.url, "kind": "vllm", "model": REC, "name": "rec", "priority_scheduling": True},
        {"url": dead_url, "kind": "openai", "model": DOWN, "name": "gone"},
    ]
    # a slow health check on a busy machine must not eject an engine mid-run (the data path still
    # ejects one that refuses connections, and the dead one is never admitted in the first place)
    return {
        "engines": engines,
        "max_body_bytes": MAX_BODY,
        "default_max_tokens": 4,
        "eject_after_failures": 1000,
        **overrides,
    }


KEYED: dict[str, Any] = {
    "api_keys": [CLIENT_KEY],
    "admin_api_keys": [ADMIN_KEY],
    "api_key_policies": {POLICY_KEY: {"max_priority": 1, "min_ttft_ms": 1200}},
}


# -- the gateway as a plain ASGI app -----------------------------------------------------------


@dataclass
class Wire:
    """One request as it reaches the app: any header bytes, the body in ASGI chunks."""

    method: str
    path: str
    headers: Headers
    chunks: list[bytes]
    query: bytes = b""
    #: the client goes away instead of sending chunk number ``disconnect_at``
    disconnect_at: int | None = None

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class Answer:
    status: int | None = None
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    problems: list[str] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        values = [v for k, v in self.headers if k.lower() == name]
        return values[-1] if values else None


class AsgiHost:
    """Gateway apps on an event loop of their own (a thread), started and stopped through the
    ASGI lifespan protocol as uvicorn would; requests are awaited there from the test thread."""

    def __init__(self) -> None:
        self._io = LoopThread("fuzz-asgi")
        self.loop = self._io.loop
        self.apps: dict[str, FrontDoor] = {}
        self._lifespans: list[tuple[asyncio.Task[None], asyncio.Event, list[Message]]] = []

    def __enter__(self) -> AsgiHost:
        self._io.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self._shutdown())
        finally:
            self._io.stop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = _TIMEOUT_S + 10) -> T:
        return self._io.run(coro, timeout)

    def add(self, name: str, settings: Settings) -> FrontDoor:
        app = create_app(settings)
        self.run(self._startup(app))
        self.apps[name] = app
        return app

    def request(self, name: str, wire: Wire) -> Answer:
        return self.run(exchange(self.apps[name], wire))

    async def _startup(self, app: FrontDoor) -> None:
        started: asyncio.Future[Message] = self.loop.create_future()
        stop = asyncio.Event()
        sent: list[Message] = []
        inbox: list[Message] = [{"type": "lifespan.startup"}]

        async def receive() -> Message:
            if inbox:
                return inbox.pop()
            await stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: Message) -> None:
            sent.append(message)
            if message["type"].startswith("lifespan.startup.") and not started.done():
                started.set_result(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        task = asyncio.create_task(app(scope, receive, send))
        pending: set[asyncio.Future[Any]] = {started, task}
        await asyncio.wait(pending, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert started.done(), f"lifespan startup did not finish: {task}"
        assert started.result()["type"] == "lifespan.startup.complete", started.result()
        self._lifespans.append((task, stop, sent))

    async def _shutdown(self) -> None:
        for task, stop, sent in self._lifespans:
            stop.set()
            await asyncio.wait_for(task, 30)
            assert sent[-1]["type"] == "lifespan.shutdown.complete", sent[-1]


async def exchange(app: FrontDoor, wire: Wire) -> Answer:
    """Call ``app`` with ``wire`` as an ASGI server would, recording what it sends and any breach
    of the protocol; after the body (or a response) the next receive is the disconnect."""
    answer = Answer()
    finished = asyncio.Event()
    pending = list(wire.chunks) or [b""]
    sent_chunks = 0
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": wire.method,
        "scheme": "http",
        "path": wire.path,
        "raw_path": wire.path.encode(),
        "query_string": wire.query,
        "root_path": "",
        "headers": wire.headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }

    async def receive() -> Message:
        nonlocal sent_chunks
        if wire.disconnect_at is not None and sent_chunks == wire.disconnect_at:
            return {"type": "http.disconnect"}
        if sent_chunks < len(pending):
            chunk = pending[sent_chunks]
            sent_chunks += 1
            return {"type": "http.request", "body": chunk, "more_body": sent_chunks < len(pending)}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        kind = message.get("type")
        if answer.complete:
            answer.problems.append(f"message after the final body: {kind}")
        elif kind == "http.response.start":
            if answer.status is not None:
                answer.problems.append("a second http.response.start")
            status = message.get("status")
            if type(status) is not int:
                answer.problems.append(f"status is not an int: {status!r}")
            answer.status = status
            for item in message.get("headers", []):
                if not (isinstance(item, tuple | list) and len(item) == 2):
                    answer.problems.append(f"bad header item {item!r}")
                    continue
                name, value = item
                if not isinstance(name, bytes) or not isinstance(value, bytes):
                    answer.problems.append(f"header not bytes: {item!r}")
                    continue
                if name != name.lower():
                    answer.problems.append(f"header name not lower-case: {name!r}")
                if _BAD_HEADER_VALUE.search(name + value):
                    answer.problems.append(f"header could split the response: {item!r}")
                answer.headers.append((name, value))
        elif kind == "http.response.body":
            if answer.status is None:
                answer.problems.append("body before http.response.start")
            answer.body += message.get("body", b"")
            if not message.get("more_body", False):
                answer.complete = True
                finished.set()
        else:
            answer.problems.append(f"unknown message {kind!r}")

    try:
        await asyncio.wait_for(app(scope, receive, send), _TIMEOUT_S)
    except TimeoutError:
        answer.problems.append(f"the app did not finish within {_TIMEOUT_S} s")
    except Exception as exc:  # what a server turns into a plain-text 500
        answer.problems.append(f"exception escaped the app: {exc!r}")
    finally:
        finished.set()
    return answer


# -- the same over a real HTTP server ------------------------------------------------------------


def raw_http(base_url: str, wire: Wire) -> Answer:
    """``wire`` as HTTP/1.1 bytes on a fresh connection (``Connection: close``), read to EOF."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    target = wire.path.encode() + (b"?" + wire.query if wire.query else b"")
    head = [wire.method.encode() + b" " + target + b" HTTP/1.1", b"host: " + host.encode()]
    head += [name + b": " + value for name, value in wire.headers]
    if not any(name == b"content-length" for name, _ in wire.headers):
        head.append(b"content-length: %d" % len(wire.body))
    head.append(b"connection: close")
    data = b"\r\n".join(head) + b"\r\n\r\n" + wire.body
    received = bytearray()
    with socket.create_connection((host, port), timeout=_TIMEOUT_S) as sock:
        # answered (413) before the body was taken: the answer is still there to read
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        while chunk := _recv(sock):
            received += chunk
    return parse_http(bytes(received))


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def parse_http(data: bytes) -> Answer:
    answer = Answer()
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        answer.problems.append(f"no complete response head: {data[:200]!r}")
        return answer
    status_line, *lines = head.split(b"\r\n")
    answer.status = int(status_line.split(b" ")[1])
    for line in lines:
        name, _, value = line.partition(b":")
        answer.headers.append((name.strip().lower(), value.strip()))
    if answer.header(b"transfer-encoding") == b"chunked":
        body = bytearray()
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                answer.complete = True
                break
            body += rest[:size]
            rest = rest[size + 2 :]
        answer.body = bytes(body)
    else:
        length = answer.header(b"content-length")
        answer.body = rest if length is None else rest[: int(length)]
        answer.complete = length is None or len(rest) >= int(length)
    return answer


# -- what a request should get -----------------------------------------------------------------


@dataclass
class Case:
    """A generated request and what the generator knows about the answer it should get."""

    wire: Wire
    gateway: str
    #: the statuses allowed; None when the generator cannot tell (any documented non-500 one)
    expect: frozenset[int] | None
    kind: RouteKind | None = None
    stream: bool = False
    wants_usage: bool = False
    model: str | None = None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _positive(value: Any) -> bool:
    return _is_int(value) and value >= 1


def judge_body(kind: RouteKind, raw: bytes, pristine: bool) -> tuple[Verdict, dict[str, Any] | None]:
    """The gateway's documented body rules (README, request_parse): "bad" when the body must be a
    400 before any engine sees it; else "ok" for a body built valid, "any" for a mutated one that
    only an engine may refuse."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "bad", None
    if not isinstance(body, dict):
        return "bad", None
    model = body.get("model")
    stream = body.get("stream")
    stream = False if stream is None else stream  # (null is the default, as vLLM reads it)
    options = body.get("stream_options")
    if (
        not isinstance(model, str)
        or not model
        or not isinstance(stream, bool)
        or (options is not None and (not stream or not isinstance(options, dict)))
        or not _is_int(body.get("priority", 0))
    ):
        return "bad", body
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "bad", body
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return "bad", body
    elif kind == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list)
            and prompt
            and (
                all(_is_int(p) for p in prompt)
                or all(isinstance(p, str) for p in prompt)
                or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
            )
        ):
            return "bad", body
    else:
        value = body.get("input")
        if not isinstance(value, str) and not (isinstance(value, list) and value):
            return "bad", body
    if kind != "embeddings":
        first = body.get("max_completion_tokens")
        if first is not None and not _positive(first):
            return "bad", body
        if not _positive(first):
            second = body.get("max_tokens")
            if second is not None and not _positive(second):
                return "bad", body
    return ("ok" if pristine else "any"), body


def expectation(
    gateway: str,
    method: str,
    path: str,
    auth: Verdict | Literal["admin"],
    declared_too_large: bool,
    body_len: int,
    body: Verdict,
    headers: Verdict,
    model: str | None,
) -> frozenset[int] | None:
    """The proxy's order: key, method, size, body and SLO headers, then the model's engines."""
    if path not in DATA_PATHS:
        return other_expectation(gateway, method, path, auth)
    if gateway == "keyed":
        if auth == "bad":
            return frozenset({401})
        if auth == "admin":
            return frozenset({403})
    if auth == "any":
        return None
    if method != "POST":
        return frozenset({405})
    if declared_too_large or body_len > MAX_BODY:
        return frozenset({413})
    if "bad" in (body, headers):
        return frozenset({400})
    if "any" in (body, headers):
        return None
    if model in (MODEL, REC):
        return frozenset({200})
    return frozenset({503}) if model == DOWN else frozenset({404})


def other_expectation(
    gateway: str, method: str, path: str, auth: Verdict | Literal["admin"]
) -> frozenset[int] | None:
    """The FastAPI routes: the key check by path prefix first, then the route and its method."""
    if path in ("/nope", "/v1/nope", "/"):
        return frozenset({404})
    if gateway == "keyed" and path != "/health" and path != "/ready":
        if auth == "any":
            return None
        admin_only = path in ("/admin/engines", "/metrics")
        if auth == "bad":
            return frozenset({401})
        if (auth == "admin") != admin_only:
            return frozenset({403})
    if method != "GET":
        return frozenset({405})
    # /ready: the model "down" has no engine, but the others do, so this replica can serve
    return frozenset({200})


# -- checking an answer ------------------------------------------------------------------------


def check(case: Case, answer: Answer, recorder: RecordingEngine) -> None:
    wire = case.wire
    if currently_in_test_context():  # for --hypothesis-show-statistics
        event(f"status {answer.status}, {'predicted' if case.expect else 'unpredicted'}")
    received, violations = recorder.take()
    where = f"{wire.method} {wire.path} headers={wire.headers!r:.600} body={wire.body!r:.400}"
    assert not answer.problems, f"{answer.problems} for {where}"
    assert not violations, f"the recording engine was sent {violations} for {where}"
    if answer.status is None:
        # only a client that left before the answer may go without one
        assert wire.disconnect_at is not None, f"no answer for {where}"
        return
    status = answer.status
    shown = f"{status} {answer.headers!r:.300} {answer.body!r:.600} for {where}"
    assert status != 500 and status < 600, f"server error {shown}"
    if wire.disconnect_at is not None:
        return  # what a client that left is sent (if anything) is nobody's to read
    assert answer.complete, f"incomplete answer {shown}"
    if case.expect is not None:
        assert status in case.expect, f"expected {sorted(case.expect)}, got {shown}"
    data_path = wire.path in DATA_PATHS
    if data_path:
        assert status in DATA_STATUSES, f"undocumented status {shown}"
        check_request_id(wire, answer, shown)
    if 300 <= status < 400:
        assert answer.header(b"location"), f"a redirect without a location {shown}"
    elif status >= 400:
        check_error(answer, data_path, shown)
    elif data_path:
        check_success(case, answer, received, shown)
    else:
        content_type = answer.header(b"content-type") or b""
        if content_type.startswith(b"application/json"):
            orjson.loads(answer.body)


def check_request_id(wire: Wire, answer: Answer, shown: str) -> None:
    """Every data-path answer carries an id: the client's when it is visible ASCII (at most 128
    characters), else one the gateway made up."""
    given = [v for k, v in wire.headers if k == b"x-request-id"]
    echoed = answer.header(b"x-request-id")
    assert echoed is not None and _CLIENT_ID.fullmatch(echoed), f"bad x-request-id {shown}"
    if len(given) == 1 and _CLIENT_ID.fullmatch(given[0]):
        assert echoed == given[0], f"the client's x-request-id was not echoed {shown}"
    elif echoed not in given:
        assert echoed.startswith(b"sg-"), f"odd x-request-id {shown}"


def check_error(answer: Answer, data_path: bool, shown: str) -> None:
    status = answer.status
    assert status is not None
    content_type = answer.header(b"content-type") or b""
    assert content_type.startswith(b"application/json"), f"error is not JSON {shown}"
    try:
        payload = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        pytest.fail(f"error body is not JSON {shown}")
    assert isinstance(payload, dict) and set(payload) == {"error"}, f"not OpenAI-shaped {shown}"
    error = payload["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, shown
    assert isinstance(error["message"], str) and error["message"], shown
    assert isinstance(error["type"], str) and error["type"], shown
    assert error["param"] is None or isinstance(error["param"], str), shown
    assert error["code"] is None or isinstance(error["code"], str), shown
    if status in ERROR_TYPES:
        assert error["type"] == ERROR_TYPES[status], f"type {error['type']!r} for {status}: {shown}"
    if status == 401:
        challenge = answer.header(b"www-authenticate") or b""
        assert challenge.startswith(b"Bearer"), f"401 without a Bearer challenge {shown}"
    if data_path and status in (429, 503):
        retry = answer.header(b"retry-after") or b""
        assert retry.isdigit() and int(retry) >= 1, f"{status} without a Retry-After {shown}"


def check_success(
    case: Case, answer: Answer, received: list[tuple[dict[str, str], dict[str, Any]]], shown: str
) -> None:
    wire = case.wire
    assert answer.status == 200, shown
    assert answer.header(b"x-slo-class"), shown
    for name in (b"x-slo-ttft-ms", b"x-slo-tpot-ms"):
        value = answer.header(name) or b""
        assert value.isdigit(), f"{name!r} is {value!r}: {shown}"
    engine = answer.header(b"x-slogate-engine")
    assert engine in (b"sim", b"rec"), shown
    kind = case.kind
    assert kind is not None
    content_type = answer.header(b"content-type") or b""
    if case.stream and kind != "embeddings":
        assert content_type.startswith(b"text/event-stream"), shown
        check_stream(kind, answer.body, case.wants_usage, shown)
    else:
        assert content_type.startswith(b"application/json"), shown
        data = orjson.loads(answer.body)
        assert isinstance(data, dict) and "error" not in data, shown
        if kind == "embeddings":
            assert data["object"] == "list" and data["data"], shown
            assert all(isinstance(d["embedding"], list | str) for d in data["data"]), shown
        else:
            assert data["object"] == ("chat.completion" if kind == "chat" else "text_completion"), shown
            assert isinstance(data["choices"], list) and data["choices"], shown
    if engine == b"rec":
        assert received, f"the recording engine saw nothing {shown}"
        forwarded, body = received[-1]
        assert body.get("model") == case.model, shown
        traces = [v for k, v in wire.headers if k == b"traceparent"]
        if len(traces) == 1 and re.fullmatch(rb"[\x20-\x7e]{0,1024}", traces[0]) and traces[0].strip():
            assert forwarded.get("traceparent") == traces[0].strip().decode(), f"traceparent lost {shown}"


def check_stream(kind: RouteKind, body: bytes, wants_usage: bool, shown: str) -> None:
    assert body.endswith(b"\n\n"), f"stream not ended by an event {shown}"
    events = body[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]", f"stream does not end with [DONE] {shown}"
    expected = "chat.completion.chunk" if kind == "chat" else "text_completion"
    usage_seen = False
    for sse in events[:-1]:
        assert sse.startswith(b"data: "), f"not an SSE data event: {sse!r:.200} in {shown}"
        chunk = orjson.loads(sse[6:])
        assert isinstance(chunk, dict) and "error" not in chunk, f"error event {sse!r:.300} in {shown}"
        assert chunk.get("object") == expected, f"{sse!r:.200} in {shown}"
        if isinstance(chunk.get("usage"), dict):
            usage_seen = True
            assert chunk.get("choices") or wants_usage, f"usage chunk nobody asked for {shown}"
    assert usage_seen or not wants_usage, f"usage asked for and not sent {shown}"


# -- generating requests -----------------------------------------------------------------------
#
# Hypothesis favours the ends of an integer range (and the simplest values) over a uniform draw,
# so the knobs below keep the rare outcome in the middle of a range (``chance``) and the common
# one first in a weighted pick.


_SAMPLED: dict[tuple[tuple[type, Any], ...], st.SearchStrategy[Any]] = {}


def sampled(values: Sequence[Any]) -> st.SearchStrategy[Any]:
    """``st.sampled_from(values)``, made once per distinct list: generators call it per draw,
    and every new strategy is validated and has its properties worked out again (a quarter of
    the generation time)."""
    try:
        key = tuple((type(v), v) for v in values)
        hash(key)
    except TypeError:  # (unhashable values: made each time)
        return st.sampled_from(values)
    strategy = _SAMPLED.get(key)
    if strategy is None:
        strategy = _SAMPLED[key] = st.sampled_from(list(values))
    return strategy


def chance(draw: st.DrawFn, percent: int) -> bool:
    """True about ``percent`` % of the time (at most 49)."""
    return 50 <= draw(st.integers(0, 99)) < 50 + percent


def pick(draw: st.DrawFn, weights: dict[str, int]) -> str:
    """A key of ``weights`` with about that relative frequency (the first and last a bit more)."""
    roll = draw(st.integers(0, sum(weights.values()) - 1))
    for key, weight in weights.items():
        if roll < weight:
            return key
        roll -= weight
    raise AssertionError("unreachable")


TEXT = st.text(max_size=24)
SMALL_BYTES = st.binary(max_size=40)
NASTY = [b"", b" ", b"\t", b"\x00", b"\xff\xfe", b"\xc3\x28", b"\xe2\x82\xac", b"\xed\xa0\x80", b"\x7f"]
NASTY += [b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"1e20", b"1e308", b"1e309", b"-1", b"--1", b"+-1"]
NASTY += [b"0x10", b"1_000", b"\xd9\xa3", b"\xef\xbc\x91", b"9" * 40, b"-" + b"9" * 40, b"a" * 2000]
NASTY += [b"\x1b[31m", b"1\r\nx-injected: 1", b"\\u0000"]
nasty = st.sampled_from(NASTY)
#: header values whose meaning the generator does not know
unknown = st.one_of(nasty, SMALL_BYTES)


def _fmt(value: float | int) -> bytes:
    return str(value).encode()


def _padded(draw: st.DrawFn, value: bytes) -> bytes:
    return draw(sampled([b"", b" ", b"\t"])) + value + draw(sampled([b"", b" ", b"\t"]))


OK_PRIORITIES = [b"9999999", b"-9999999", b"0", b"-0", b"+0", b"0003"]
BAD_PRIORITIES = [b"--1", b"+-1", b"", b" ", b"1e3", b"nan", b"inf", b"1.5", b"0x10", b"1_000", b"\xff\xfe"]
BAD_PRIORITIES += [b"\xd9\xa3", b"\xef\xbc\x91", b"1 2", b"- 1", b"\x00", b"a" * 300]
OK_TARGETS = [
    b"1e20",
    b"1E20",
    b"1e300",
    b"1e308",
    b"9" * 400,
    b"86400001",
    b"250",
    b"0.5",
    b"1",
    b"+7",
    b"1_0",
]
#: beyond a float: a day, or a 400 (the gateway clamps them today)
HUGE_TARGETS = [b"inf", b"Infinity", b"+inf", b"1e309", b"9" * 400 + b".0e10"]
BAD_TARGETS = [b"0", b"-0", b"-4", b"-1e20", b"nan", b"NaN", b"-nan", b"", b" ", b"abc", b"\xff", b"1e-400"]
BAD_TARGETS += [b"--1", b"0x10", b"1,5", b"\xef\xbc\x91", b"1e", b"-inf"]
OK_TASKS = [b"medical_qa", b"wikisql", b"tldr_content_gen", b"no-such-task", b"a b"]
BAD_TASKS = [b"\xff\xfe", b"\xc3\xa9t\xc3\xa9", b"a\x00b", b"tab\there", b"\x7f", b"x" * 257, b"\x1b[31m"]
PRINTABLE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=256)


@st.composite
def priority_values(draw: st.DrawFn) -> tuple[bytes, Verdict]:
    """x-priority: an integer (clamped to the profile's levels); anything else is a 400."""
    match pick(draw, {"ok": 45, "edge": 15, "bad": 25, "unknown": 15}):
        case "ok":
            number = draw(st.integers(-1000, 1000))
            return _padded(draw, (b"+" if number >= 0 and chance(draw, 30) else b"") + _fmt(number)), "ok"
        case "edge":
            return draw(sampled(OK_PRIORITIES)), "ok"
        case "bad":
            return draw(sampled(BAD_PRIORITIES)), "bad"
    return draw(unknown), "any"


@st.composite
def target_values(draw: st.DrawFn) -> tuple[bytes, Verdict]:
    """x-slo-ttft-ms / x-slo-tpot-ms: a positive number of ms; huge ones are clamped to a day,
    so ``1e20`` must be served (it once overflowed as the engine's integer priority)."""
    match pick(draw, {"ok": 40, "edge": 15, "bad": 25, "huge": 8, "unknown": 12}):
        case "ok":
            number = draw(st.floats(min_value=1e-3, max_value=1e300, allow_nan=False, allow_infinity=False))
            return _padded(draw, _fmt(number)), "ok"
        case "edge":
            return draw(st.one_of(sampled(OK_TARGETS), st.integers(1, 10**30).map(_fmt))), "ok"
        case "bad":
            return draw(sampled(BAD_TARGETS)), "bad"
        case "huge":
            return draw(sampled(HUGE_TARGETS)), "any"
    return draw(unknown), "any"


@st.composite
def task_values(draw: st.DrawFn) -> tuple[bytes, Verdict]:
    """x-slo-task: printable ASCII of at most 256 characters (an unknown task is no error)."""
    match pick(draw, {"ok": 55, "bad": 30, "unknown": 15}):
        case "ok":
            return draw(st.one_of(sampled(OK_TASKS), PRINTABLE.map(str.encode))), "ok"
        case "bad":
            return draw(sampled(BAD_TASKS)), "bad"
    return draw(unknown), "any"


def free_values(*typical: bytes) -> Callable[[], st.SearchStrategy[tuple[bytes, Verdict]]]:
    """A header whose value never changes the status: anything at all, or a typical value."""
    values = st.one_of(unknown, TEXT.map(str.encode), *([sampled(typical)] if typical else []))
    return lambda: values.map(lambda v: (v, "ok"))


TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
HeaderValues = Callable[[], st.SearchStrategy[tuple[bytes, Verdict]]]
SLO_HEADERS: dict[bytes, HeaderValues] = {
    b"x-priority": priority_values,
    b"x-slo-ttft-ms": target_values,
    b"x-slo-tpot-ms": target_values,
    b"x-slo-task": task_values,
}
FREE_HEADERS: dict[bytes, HeaderValues] = {
    b"x-request-id": free_values(b"req-1", b"a" * 128, b"a" * 129, b"id with space", b"\xff\xfe-not-utf8"),
    b"traceparent": free_values(TRACEPARENT, b"00-\xff\xfe-01"),
    b"tracestate": free_values(b"k=v", b"\xc3\x28=1"),
    b"content-type": free_values(b"application/json", b"text/plain", b"application/json; charset=latin-1"),
    b"accept": free_values(b"*/*", b"text/event-stream"),
    b"x-junk": free_values(),
}
SIM_HEADERS = (b"x-sim-fault", b"x-sim-output-len")
HEADER_NAMES = [*SLO_HEADERS, *SLO_HEADERS, *FREE_HEADERS, *SIM_HEADERS]


@st.composite
def sim_values(draw: st.DrawFn) -> bytes:
    """``x-sim-*`` values; none that would hang, slow or crash the engine every test shares."""
    value = draw(st.one_of(unknown, sampled([b"1", b"3", b"0", b"-2", b"bogus", b"x=1", b"\xfe\xff"])))
    return b"" if any(fault in value for fault in _SIM_FAULTS) else value


@dataclass
class HeaderDraw:
    headers: Headers
    verdict: Verdict
    auth: Verdict | Literal["admin"]
    declared_too_large: bool


@st.composite
def authorization(draw: st.DrawFn) -> tuple[bytes | None, Verdict | Literal["admin"]]:
    """A client key (any scheme case, any spacing), the policy key, the admin key, none, or junk."""
    match pick(draw, {"client": 60, "policy": 8, "admin": 6, "missing": 8, "wrong": 18}):
        case "client":
            scheme = draw(sampled([b"Bearer", b"bearer", b"BEARER", b"bEaReR"]))
            space = draw(sampled([b" ", b"  ", b"\t"]))
            return _padded(draw, scheme + space + CLIENT_KEY.encode()), "ok"
        case "policy":
            return b"Bearer " + POLICY_KEY.encode(), "ok"
        case "admin":
            return b"Bearer " + ADMIN_KEY.encode(), "admin"
        case "missing":
            return None, "bad"
    near = [b"Bearer", b"Bearer ", b"Basic " + CLIENT_KEY.encode(), CLIENT_KEY.encode()]
    near += [b"Bearer " + CLIENT_KEY.encode()[:-1], b"Bearer " + CLIENT_KEY.upper().encode()]
    return draw(st.one_of(unknown, sampled(near), SMALL_BYTES.map(lambda b: b"Bearer " + b))), "bad"


def _combine(verdicts: list[Verdict]) -> Verdict:
    if "bad" in verdicts:
        return "bad"
    return "any" if "any" in verdicts else "ok"


def _http_value(value: bytes) -> bytes:
    """``value`` as HTTP/1.1 can carry it: no control bytes but tab, no surrounding whitespace
    (obs-text 0x80-0xff stays: the server hands it to the app as it came)."""
    kept = bytes(b for b in value if b == 0x09 or 0x20 <= b <= 0x7E or b >= 0x80)
    return kept.strip(b" \t")


@st.composite
def header_sets(
    draw: st.DrawFn, body: bytes, *, http: bool = False, forwards_sim: bool = False, heavy: bool = True
) -> HeaderDraw:
    """Headers from those the gateway reads, with any values (or, for ``http``, what HTTP/1.1
    carries), repeats, and a declared content length that may be absent, wrong or huge."""
    chosen = draw(st.lists(sampled(HEADER_NAMES), max_size=8 if heavy else 2))
    items: list[tuple[bytes, bytes, Verdict]] = []
    for name in chosen:
        verdict: Verdict
        if name in SIM_HEADERS:
            value, verdict = draw(sim_values()), ("any" if forwards_sim else "ok")
        elif name in SLO_HEADERS:
            value, verdict = draw(SLO_HEADERS[name]())
        else:
            value, verdict = draw(FREE_HEADERS[name]())
        if http:
            # what HTTP cannot carry is dropped; a value changed that way has no known verdict
            carried = _http_value(value)
            value, verdict = carried, (verdict if carried == value else "any")
        items.append((name, value, verdict))
    # the gateway reads the last of repeated headers: a verdict only holds if the repeats agree
    repeats: dict[bytes, set[Verdict]] = {}
    for name, _, verdict in items:
        repeats.setdefault(name, set()).add(verdict)
    verdict = _combine([next(iter(v)) if len(v) == 1 else "any" for v in repeats.values()])
    headers = [(name, value) for name, value, _ in items]
    auth_value, auth = draw(authorization())
    if auth_value is not None:
        headers.insert(draw(st.integers(0, len(headers))), (b"authorization", auth_value))
        if chance(draw, 3):
            headers.append((b"authorization", draw(SMALL_BYTES)))
            auth = "any"
    if http:
        headers = [(name, _http_value(value)) for name, value in headers]
    declared_too_large = False
    match pick(
        draw,
        {"none": 50, "true": 20, "huge": 10, "junk": 10, "wrong": 10}
        if not http
        else {"none": 96, "huge": 4},
    ):
        case "true":
            headers.append((b"content-length", _fmt(len(body))))
        case "huge":
            limit = 10**12 if http else 10**30  # beyond 2**64 httptools itself refuses the request
            headers.append((b"content-length", _fmt(draw(st.integers(MAX_BODY + 1, limit)))))
            declared_too_large = True
        case "junk":
            value = draw(unknown)
            headers.append((b"content-length", value))
            declared_too_large = value.isdigit() and int(value) > MAX_BODY
        case "wrong":
            headers.append((b"content-length", _fmt(draw(st.integers(0, MAX_BODY)))))
    return HeaderDraw(headers, verdict, auth, declared_too_large)


JSON_JUNK: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
#: fields a body may be mutated in; never ``n``, ``ignore_eos`` or ``min_tokens``, with which a
#: body could make the engine every test shares generate without end
MUTABLE_FIELDS = ["model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens"]
MUTABLE_FIELDS += ["max_completion_tokens", "priority", "temperature", "top_p", "stop", "user", "seed"]
MUTABLE_FIELDS += ["logprobs", "tools", "encoding_format", "dimensions", "response_format", "extra_junk"]
SPECIAL_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1, 2**64]
SPECIAL_VALUES += [
    -(2**63),
    10**30,
    1.5,
    float("nan"),
    float("inf"),
    -float("inf"),
    "",
    "m",
    "rec",
    "x" * 5000,
]
SPECIAL_VALUES += [
    [],
    {},
    [[]],
    [None],
    [1, "a"],
    [True],
    ["hi", 5],
    [[1, 2], [3]],
    [[1, "a"]],
    {"role": "user"},
]
SPECIAL_VALUES += [
    {"include_usage": True},
    [{"role": "user", "content": "hi"}],
    [{"role": 5, "content": "hi"}],
]
SPECIAL_VALUES += [
    [{"content": "hi"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
]
NOT_OBJECTS = [b"", b"null", b"[]", b"1", b'"hi"', b"true", b"[" * 3000 + b"]" * 3000, b"\xff\xfe{\x00"]
NOT_OBJECTS += [b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"model":NaN}', b'{"model":"m","max_tokens":1e999}']
NOT_OBJECTS += [b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}']
NOT_OBJECTS += [b'{"model":"m\xc3\x28","prompt":"x","input":"x"}']
NOT_OBJECTS += [b'{"model":"m","prompt":"\\ud800","input":"\\ud800","messages":[]}']


@dataclass
class Body:
    raw: bytes
    verdict: Verdict
    model: str | None
    stream: bool
    wants_usage: bool


@st.composite
def valid_body(draw: st.DrawFn, kind: RouteKind) -> dict[str, Any]:
    """A request body the gateway and both engines accept, for a served model or another one."""
    models = {MODEL: 35, REC: 35, DOWN: 5, "gpt-unknown": 10, "text": 15}
    model = pick(draw, models)
    body: dict[str, Any] = {"model": draw(TEXT) if model == "text" else model}
    if kind == "chat":
        content: Any = draw(TEXT)
        if chance(draw, 20):
            content = [{"type": "text", "text": content}]
        role = draw(sampled(["user", "system", "assistant"]))
        system = [{"role": "system", "content": "be brief"}] if chance(draw, 20) else []
        body["messages"] = [*system, {"role": role, "content": content}]
    elif kind == "completions":
        one_token_list = st.lists(st.integers(1, 1000), min_size=1, max_size=4)
        body["prompt"] = draw(
            st.one_of(
                TEXT.filter(bool),
                TEXT.filter(bool).map(lambda t: [t]),
                st.lists(st.integers(1, 1000), min_size=1, max_size=8),
                one_token_list.map(lambda t: [t]),
            )
        )
    else:
        texts = st.lists(TEXT.filter(bool), min_size=1, max_size=3)
        body["input"] = draw(st.one_of(TEXT.filter(bool), texts))
    if kind != "embeddings":
        body[draw(sampled(["max_tokens", "max_completion_tokens"]))] = draw(st.integers(1, 4))
        match pick(draw, {"plain": 40, "stream": 25, "usage": 25, "false": 10}):
            case "stream":
                body["stream"] = True
            case "usage":
                body["stream"] = True
                body["stream_options"] = {"include_usage": draw(st.booleans())}
            case "false":
                body["stream"] = False
    if chance(draw, 25):
        body["priority"] = draw(st.one_of(st.integers(-1000, 1000), sampled([2**62, -(2**63)])))
    if kind != "embeddings" and chance(draw, 25):
        body["temperature"] = draw(sampled([0, 0.5, 1.0]))
    return body


def serialise(draw: st.DrawFn, body: Any) -> bytes:
    """JSON the way varied clients write it (stdlib json: big integers and NaN go through)."""
    if draw(st.booleans()):
        return json.dumps(body).encode()
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw: st.DrawFn, kind: RouteKind, *, mutate: bool = True) -> Body:
    """A valid body, a mutated one (wrong types, huge numbers, nested junk, long strings), or bytes
    that are not a JSON object at all."""
    body = draw(valid_body(kind))
    weights = {"valid": 30, "mutated": 40, "long": 8, "broken": 8, "not-object": 7, "bytes": 7}
    shape = pick(draw, weights) if mutate else "valid"
    pristine = shape == "valid"
    match shape:
        case "mutated":
            for _ in range(draw(st.integers(1, 3))):
                key = draw(sampled(MUTABLE_FIELDS))
                if chance(draw, 15):
                    body.pop(key, None)
                else:
                    body[key] = draw(st.one_of(sampled(SPECIAL_VALUES), JSON_JUNK))
            raw = serialise(draw, body)
        case "long":
            # very long text: near the body limit or past it
            size = draw(sampled([1000, MAX_BODY // 2, MAX_BODY - 200, MAX_BODY + 1, 4 * MAX_BODY]))
            filler = draw(sampled(["a", "é", "日本", " ", "\\"])) * (size // 2)
            field_name = {"chat": "messages", "completions": "prompt", "embeddings": "input"}[kind]
            body[field_name] = [{"role": "user", "content": filler}] if kind == "chat" else filler
            raw = serialise(draw, body)
            pristine = True
        case "broken":
            valid = serialise(draw, body)
            cut = draw(st.integers(0, len(valid) - 1))
            spoilt = [valid[:cut], valid + b"}", valid + b" \n", b"\xef\xbb\xbf" + valid, valid + b"\x00"]
            spoilt += [
                valid.replace(b"{", b"[", 1),
                valid.replace(b'"', b"'"),
                valid[:cut] + b"\xff" + valid[cut:],
            ]
            raw = draw(st.sampled_from(spoilt))  # (new lists each time: nothing to reuse)
            pristine = raw == valid + b" \n"
        case "not-object":
            raw = draw(sampled(NOT_OBJECTS))
        case "bytes":
            raw = draw(st.binary(max_size=300))
        case _:
            raw = serialise(draw, body)
    verdict, parsed = judge_body(kind, raw, pristine)
    model = parsed.get("model") if parsed is not None else None
    stream = bool(parsed is not None and parsed.get("stream") is True)
    options = parsed.get("stream_options") if parsed is not None else None
    wants_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    return Body(raw, verdict, model if isinstance(model, str) else None, stream, wants_usage)


def chunked(draw: st.DrawFn, raw: bytes) -> list[bytes]:
    """The body as an ASGI server may deliver it: whole, or cut anywhere into a few chunks."""
    if not raw or not chance(draw, 30):
        return [raw]
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), min_size=1, max_size=4)))
    tail = [b""] if chance(draw, 30) else []
    return [raw[a:b] for a, b in itertools.pairwise([0, *cuts, len(raw)])] + tail


@st.composite
def data_requests(
    draw: st.DrawFn,
    *,
    gateways: tuple[str, ...] = ("keyed", "open"),
    heavy_headers: bool = True,
    mutate_bodies: bool = True,
    odd_methods: bool = False,
    http: bool = False,
) -> Case:
    gateway = draw(sampled(gateways))
    path = draw(sampled(list(DATA_PATHS)))
    kind = DATA_PATHS[path]
    method = "POST"
    if odd_methods and chance(draw, 20):
        method = draw(sampled(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", *([] if http else ["HEAD"])]))
    body = draw(bodies(kind, mutate=mutate_bodies))
    drawn = draw(header_sets(body.raw, http=http, forwards_sim=gateway == "open", heavy=heavy_headers))
    expect = expectation(
        gateway,
        method,
        path,
        drawn.auth,
        drawn.declared_too_large,
        len(body.raw),
        body.verdict,
        drawn.verdict,
        body.model,
    )
    wire = Wire(method, path, drawn.headers, [body.raw] if http else chunked(draw, body.raw))
    if odd_methods and not http and chance(draw, 8):
        wire.disconnect_at = draw(st.integers(0, len(wire.chunks)))
    return Case(wire, gateway, expect, kind, body.stream, body.wants_usage, body.model)


@st.composite
def other_requests(
    draw: st.DrawFn, *, gateways: tuple[str, ...] = ("keyed", "open"), http: bool = False
) -> Case:
    """The FastAPI side: models, health, readiness, metrics, admin and unknown routes."""
    gateway = draw(sampled(gateways))
    path = draw(sampled(OTHER_PATHS))
    method = pick(draw, {"GET": 60, "POST": 15, "PUT": 10, "DELETE": 15})
    drawn = draw(header_sets(b"", http=http, heavy=False))
    body = draw(sampled([b"", b"{}", b"\xff"])) if method != "GET" else b""
    query = draw(sampled([b"", b"x=1", b"a=%ff&b"]))
    expect = expectation(gateway, method, path, drawn.auth, False, 0, "any", drawn.verdict, None)
    return Case(Wire(method, path, drawn.headers, [body], query), gateway, expect)


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_engine() -> Iterator[ChildProcess]:
    args = ("--profile", "zero", "--model", MODEL, "--scheduling-policy", "priority")
    with spawn_sim_engine(*args, name="fuzz-sim") as engine:
        yield engine


@pytest.fixture(scope="module")
def recorder() -> Iterator[RecordingEngine]:
    with RecordingEngine() as engine:
        yield engine


@pytest.fixture(scope="module")
def dead_url() -> Iterator[str]:
    with dead_engine_url() as url:
        yield url


@pytest.fixture(scope="module")
def asgi(sim_engine: ChildProcess, recorder: RecordingEngine, dead_url: str) -> Iterator[AsgiHost]:
    with AsgiHost() as host:
        host.add("keyed", load_settings(**fuzz_settings(sim_engine, recorder, dead_url, **KEYED)))
        open_settings = fuzz_settings(sim_engine, recorder, dead_url, forward_sim_headers=True)
        host.add("open", load_settings(**open_settings))
        yield host


@pytest.fixture(scope="module")
def http_gateway(
    sim_engine: ChildProcess, recorder: RecordingEngine, dead_url: str
) -> Iterator[RunningGateway]:
    with run_gateway(**fuzz_settings(sim_engine, recorder, dead_url, **KEYED)) as gw:
        yield gw


def run_asgi(asgi: AsgiHost, recorder: RecordingEngine, case: Case) -> Answer:
    recorder.take()
    answer = asgi.request(case.gateway, case.wire)
    check(case, answer, recorder)
    return answer


def run_http(gw: RunningGateway, recorder: RecordingEngine, case: Case) -> Answer:
    recorder.take()
    answer = raw_http(gw.url, case.wire)
    check(case, answer, recorder)
    return answer


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the fuzz tests ------------------------------------------------------------------------------


@settings(FUZZ, max_examples=900)
@given(data_requests(mutate_bodies=False))
def test_fuzzed_headers_asgi(asgi: AsgiHost, recorder: RecordingEngine, case: Case) -> None:
    """Mostly valid bodies under any header bytes: SLO claims, ids, trace context, keys, lengths."""
    run_asgi(asgi, recorder, case)


@settings(FUZZ, max_examples=600)
@given(data_requests(heavy_headers=False))
def test_fuzzed_bodies_asgi(asgi: AsgiHost, recorder: RecordingEngine, case: Case) -> None:
    run_asgi(asgi, recorder, case)


@settings(FUZZ, max_examples=300)
@given(st.one_of(data_requests(odd_methods=True, heavy_headers=False), other_requests()))
def test_fuzzed_methods_routes_and_chunking_asgi(
    asgi: AsgiHost, recorder: RecordingEngine, case: Case
) -> None:
    """Other methods and routes, bodies cut into chunks, clients leaving mid-body."""
    run_asgi(asgi, recorder, case)


@settings(FUZZ, max_examples=300)
@given(
    st.one_of(
        data_requests(gateways=("keyed",), odd_methods=True, http=True),
        other_requests(gateways=("keyed",), http=True),
    )
)
def test_fuzzed_requests_over_http(
    http_gateway: RunningGateway, recorder: RecordingEngine, case: Case
) -> None:
    """The same through uvicorn and httptools, raw bytes on the socket: what HTTP carries."""
    run_http(http_gateway, recorder, case)


# -- past defects, pinned ----------------------------------------------------------------------

CHAT = {"model": REC, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AUTH = (b"authorization", b"Bearer " + CLIENT_KEY.encode())


def pinned(
    header: bytes, value: bytes, expect: int | None, model: str, stream: bool, gateway: str = "keyed"
) -> Case:
    body = {**CHAT, "model": model, "stream": stream}
    wire = Wire("POST", "/v1/chat/completions", [AUTH, (header, value)], [orjson.dumps(body)])
    return Case(wire, gateway, None if expect is None else frozenset({expect}), "chat", stream, False, model)


#: (header, value, status or None for any but a 500): each got a 500 once, or is their next of kin
PAST_DEFECTS: list[tuple[bytes, bytes, int | None]] = [
    (b"x-request-id", b"\xff\xfe-not-utf8", 200),
    (b"x-request-id", b"\xc3\x28", 200),
    (b"x-priority", b"--1", 400),
    (b"traceparent", b"00-\xff\xfe-01", 200),
    (b"tracestate", b"\xc3\x28=1", 200),
    (b"x-sim-fault", b"\xff", 200),
    (b"x-sim-output-len", b"\xfe\xff", 200),
    (b"x-slo-task", b"\xff\xfe", 400),
    (b"x-slo-ttft-ms", b"1e20", 200),  # overflowed as the engine priority
    (b"x-slo-tpot-ms", b"1e20", 200),
    (b"x-slo-ttft-ms", b"1e308", 200),
    (b"x-slo-ttft-ms", b"inf", None),
    (b"x-slo-tpot-ms", b"1e309", None),
]


@pytest.mark.parametrize("gateway", ["keyed", "open"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", [MODEL, REC])
@pytest.mark.parametrize(("header", "value", "expect"), PAST_DEFECTS)
def test_past_defects_asgi(
    asgi: AsgiHost,
    recorder: RecordingEngine,
    header: bytes,
    value: bytes,
    expect: int | None,
    model: str,
    stream: bool,
    gateway: str,
) -> None:
    """Each value once got a plain-text 500; on the open gateway x-sim-* reach the sim's adapter."""
    recorder.take()
    case = pinned(header, value, expect, model, stream, gateway)
    answer = asgi.request(gateway, case.wire)
    received = list(recorder.received)
    check(case, answer, recorder)
    if model == REC and answer.status == 200:
        # one engine request, with an integer priority any JSON parser reads exactly
        assert len(received) == 1
        priority = received[0][1]["priority"]
        assert type(priority) is int and abs(priority) <= ENGINE_PRIORITY_LIMIT, priority
        if header.startswith(b"x-slo-ttft"):
            # the TTFT deadline in ms since the shared epoch: a huge target is clamped to a day
            now_ms = (time.time() - PRIORITY_EPOCH_S) * 1000
            assert now_ms - 60_000 < priority <= now_ms + MAX_TARGET_MS + 60_000, priority


@pytest.mark.parametrize(("header", "value", "expect"), PAST_DEFECTS)
def test_past_defects_over_http(
    http_gateway: RunningGateway, recorder: RecordingEngine, header: bytes, value: bytes, expect: int | None
) -> None:
    run_http(http_gateway, recorder, pinned(header, value, expect, REC, False))


# -- open defects ------------------------------------------------------------------------------


def test_a_content_length_of_thousands_of_digits_is_a_413(asgi: AsgiHost, recorder: RecordingEngine) -> None:
    """Only an ASGI server that passes such a header on can show it (httptools refuses lengths
    beyond 2**64 itself), but the app must not rely on that."""
    case = pinned(b"content-length", b"9" * 5000, 413, REC, False)
    run_asgi(asgi, recorder, case)
