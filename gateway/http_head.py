"""uvicorn's httptools protocol with every request's head (request line and headers) bounded.

httptools bounds neither the size nor the arrival time of a request head, and uvicorn adds no
limit of its own: a 64 MB header was read whole, before any key was checked, and since its pieces
are joined as they come (the URL by uvicorn, a header value by httptools) a 4 MB header sent in
4 KB segments cost 1.4 s of CPU on the event loop, freezing every stream the process relays. The
same held for a chunked body's trailer fields. A head arriving slowly was never timed out either
(uvicorn's keep-alive timer stops at a head's first byte, and a new connection has none), so a
client trickling headers, or sending nothing, held its connection for good.

Here what the parser is still gathering (a head, a trailer) may not pass ``max_head_bytes``: a 431.
A request's head must arrive whole within ``head_timeout_s`` of its first byte: a 408. A new
connection that sends nothing is closed as an idle kept-alive one is. Both answers are
OpenAI-shaped and end the connection, as does the 400 for what is not HTTP at all (uvicorn's is plain
text), after a moment in which what the client still sends is read and dropped (closed at once, its
unread bytes would reset the connection and could take the answer with them). The body is not
affected: its size and time are the front door's (``max_body_bytes``, ``body_timeout_s``)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.api.errors import GatewayError

#: body bytes buffered before reading pauses until the app takes them (the front door takes a
#: body as fast as it comes, so this bounds a connection's buffer, not the app's pace)
BODY_HIGH_WATER = 1024 * 1024
#: a head this long is no client's: 64 KiB holds any token or cookie header real clients send
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 10.0
#: ...and what is left of a body the app answered without reading it all must come within this
#: (the settings' body_timeout_s, which bounds a body the front door reads)
BODY_TIMEOUT_S = 60.0
#: how long a refused connection is still read (and dropped) before it is closed
LINGER_S = 2.0
#: what the request line holds besides its target (the longest method, spaces, version, CRLF)
_REQUEST_LINE_BYTES = len(b"OPTIONS  HTTP/1.1\r\n")
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class BoundedHeadProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` refusing a head past ``max_head_bytes`` or ``head_timeout_s``
    (class attributes: :func:`bounded_head_protocol` sets them).

    Size is judged twice: as bytes read since the parser last handed anything over (a head or
    trailer still arriving: its joining is what costs, so it is cut off as soon as it passes the
    limit), and for a head that ended within a read, by its target and fields as parsed (that
    read may hold the body too, which is no part of the head)."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: bytes read since the parser last handed over a part of a request
        self._unparsed = 0
        self._head_timer: asyncio.TimerHandle | None = None
        #: a head was refused: the connection is ending, what it still brings is dropped
        self._refused = False
        self._linger: asyncio.TimerHandle | None = None
        #: closes a connection whose body still arrives after its request was answered
        self._discard_timer: asyncio.TimerHandle | None = None
        #: requests a client pipelined another behind before they were answered (uvicorn's
        #: current request is the newest: only that one learns the connection is lost)
        self._superseded: list[Any] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # nothing sent yet: as idle as a kept-alive connection between requests (a pool may
        # open one ahead of its first request)
        self._arm(max(self.head_timeout_s, float(self.timeout_keep_alive)))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unparsed += len(data)
        super().data_received(data)
        if self._unparsed > self.max_head_bytes and not self._refused:
            self._refuse(self._too_large())

    # -- the parser's callbacks: measured, and ignored once the head is refused ---------------------

    def on_message_begin(self) -> None:
        if self.timeout_keep_alive_task is not None:
            # (armed when an early-answered body ended, in a read that may hold this request
            # too: uvicorn cancels it only when a read begins, and it would close this request)
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        if not self._refused:
            self._arm(self.head_timeout_s)  # (at its first byte: not a stray CRLF between requests)
            super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        # (measured only when the reads since the last part could hold a head too long: the
        # common head came within one read far below the limit)
        too_large = self._unparsed > self.max_head_bytes and self._head_size() > self.max_head_bytes
        self._unparsed = 0
        self._disarm()
        if too_large:
            self._refuse(self._too_large())
            return
        existing = self.cycle
        super().on_headers_complete()
        if existing is not None and not existing.response_complete:
            # (reading pauses behind a pipelined request: a few at most)
            self._superseded = [c for c in self._superseded if not c.response_complete]
            self._superseded.append(existing)

    def _head_size(self) -> int:
        """The request line and header fields as parsed (the read that ended them may hold the
        body too, which is no part of the head)."""
        fields = self.headers
        return _REQUEST_LINE_BYTES + len(self.url) + sum(len(n) + len(v) + 4 for n, v in fields)

    def on_body(self, body: bytes) -> None:
        # uvicorn's on_body with BODY_HIGH_WATER as the limit (its own is a module constant)
        if self._refused:
            return
        self._unparsed = 0
        cycle = self.cycle
        if cycle.response_complete and self._discard_timer is None:
            # Answered before its body was read (a 401, a 405, a 413): what is left of the body
            # is dropped as it comes, but uvicorn stops its keep-alive timer at any byte, so a
            # client that sent one more and then nothing held the connection for good. The rest
            # must come within the time a body has (body_timeout_s); then the connection ends.
            self._discard_timer = self.loop.call_later(self.body_timeout_s, self.transport.close)
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.body += body  # (a bytearray since uvicorn 0.42: appends are amortised)
        if len(cycle.body) > BODY_HIGH_WATER:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        if self._discard_timer is not None:
            # the rest came: the connection may serve the next request, idle as long as a
            # kept-alive one (its keep-alive timer was stopped by the body's bytes)
            self._discard_timer.cancel()
            self._discard_timer = None
            if not self.pipeline and self.timeout_keep_alive_task is None and not self._refused:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        if not self._refused:
            self._unparsed = 0
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # (uvicorn's is plain text; a refused head's read may hold more: its answer went out)
        if not self._refused:
            self._refuse(GatewayError(400, f"the request is not valid HTTP/1.1 ({msg})", code="invalid_http"))

    def handle_websocket_upgrade(self) -> None:
        if not self._refused:  # (a refused head leaves no request to upgrade)
            super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        superseded, self._superseded = self._superseded, []
        for cycle in superseded:
            if not cycle.response_complete:
                # (a client that pipelined a request and left: the one being answered heard
                # nothing, and went on to write to a closed transport, an error that read as a
                # 500, its engine request running until then)
                cycle.disconnected = True
                cycle.message_event.set()
        self._disarm()
        if self._discard_timer is not None:
            self._discard_timer.cancel()
            self._discard_timer = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    # -- timing and refusing ---------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(seconds, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_large(self) -> GatewayError:
        return GatewayError(
            431,
            f"the request line and header fields exceed {self.max_head_bytes} bytes",
            code="request_header_too_large",
        )

    def _head_late(self) -> None:
        self._head_timer = None
        if self._refused:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # an answer is still being written (a client pipelining its next request): the
            # next head is judged once it is done
            self._arm(self.head_timeout_s)
            return
        if self.scope is None:  # (a new connection that sent nothing: nothing to answer)
            self._refused = True
            self.transport.close()
            return
        late = GatewayError(
            408,
            f"the request line and header fields did not arrive within {self.head_timeout_s:g} s",
            code="request_timeout",
        )
        self._refuse(late)

    def _refuse(self, error: GatewayError) -> None:
        """Answer ``error`` and end the connection. A request still in the app (its trailer
        refused, or an earlier one a client pipelined) sees its client gone; one whose answer is
        being written ends with the connection at once: the answers would interleave."""
        self._refused = True
        self._disarm()
        transport = self.transport
        if transport.is_closing():
            return
        cycle = self.cycle
        if self.pipeline or (cycle is not None and cycle.response_started and not cycle.response_complete):
            # (requests a client pipelined: the newest is not the one being answered)
            transport.close()
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # (its receive answers http.disconnect, its send nothing)
            cycle.message_event.set()
        body = orjson.dumps(error.payload())
        status = b"HTTP/1.1 %d %s\r\n" % (error.status, _REASONS[error.status])
        fields = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        transport.write(status + fields + b"connection: close\r\n\r\n" + body)
        if transport.can_write_eof():
            transport.write_eof()  # the answer is whole; what the client still sends is dropped
        self.flow.resume_reading()  # (read and dropped even when a body had paused reading)
        self._linger = self.loop.call_later(LINGER_S, transport.close)


def bounded_head_protocol(
    max_head_bytes: int, head_timeout_s: float, body_timeout_s: float = BODY_TIMEOUT_S
) -> type[BoundedHeadProtocol]:
    """The protocol class for a server with these limits (uvicorn makes one instance a connection)."""
    return type(
        "BoundedHeadProtocol",
        (BoundedHeadProtocol,),
        {
            "max_head_bytes": max_head_bytes,
            "head_timeout_s": head_timeout_s,
            "body_timeout_s": body_timeout_s,
        },
    )
