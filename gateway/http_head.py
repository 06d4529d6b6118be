"""uvicorn's httptools protocol with every request's head (request line and headers) bounded.

httptools bounds neither the size nor the arrival time of a request head, and uvicorn adds no
limit of its own: a 64 MB header was read whole, before any key was checked, and since its pieces
are joined as they come (the URL by uvicorn, a header value by httptools) a 4 MB header sent in
4 KB segments cost 1.4 s of CPU on the event loop, freezing every stream the process relays. A
head arriving slowly was never timed out either (uvicorn's keep-alive timer stops at a head's
first byte), so a client trickling headers held its connection for good.

Here a head longer than ``max_head_bytes`` is refused with a 431 and one that has not arrived
whole ``head_timeout_s`` after its first byte with a 408, both OpenAI-shaped and closing the
connection. The body is not affected: its size and time are the front door's (``max_body_bytes``,
``body_timeout_s``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.api.errors import GatewayError

#: a head this long is no client's: 64 KiB holds any token or cookie header real clients send
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 10.0


class BoundedHeadProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` refusing a request head past ``max_head_bytes`` or
    ``head_timeout_s`` (class attributes: :func:`bounded_head_protocol` sets them).

    A head still arriving is measured by the reads it came in (the parser's joining is what costs,
    so it is cut off as soon as they pass the limit); a head that ends within a read, by its
    request target and header fields as the parser hands them over (that read may hold the body
    too, which is no part of the head)."""

    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: what arrives now is a request's head (at first, and after each request's body)
        self._in_head = True
        #: the head's reads so far, and its target and fields as parsed
        self._head_reads = 0
        self._head_size = 0
        self._head_timer: asyncio.TimerHandle | None = None
        #: a head was refused: the connection is closing, nothing more of it is read
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        counting = self._in_head
        if counting:
            self._head_reads += len(data)
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)
        super().data_received(data)
        if counting and self._in_head and self._head_reads > self.max_head_bytes:
            self._refuse(self._too_large())

    # -- the parser's callbacks: measured, and ignored once the head is refused ---------------------

    def on_message_begin(self) -> None:
        if not self._refused:
            self._head_size = _REQUEST_LINE_BYTES
            super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            self._head_size += len(url)
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._refused:
            self._head_size += len(name) + len(value) + 4  # (": " and CRLF)
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._end_head()
        if self._head_size > self.max_head_bytes:
            self._refuse(self._too_large())
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()
            self._in_head = True  # what comes next is the next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)

    # -- refusing ------------------------------------------------------------------------------------

    def _end_head(self) -> None:
        self._head_reads = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_large(self) -> GatewayError:
        return GatewayError(
            431,
            f"the request line and headers exceed {self.max_head_bytes} bytes",
            code="request_header_too_large",
        )

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_head and self._head_reads and not self._refused:
            self._refuse(
                GatewayError(
                    408,
                    f"the request line and headers did not arrive within {self.head_timeout_s:g} s",
                    code="request_timeout",
                )
            )

    def _refuse(self, error: GatewayError) -> None:
        """Answer ``error`` and close; while an earlier request's answer is still being written
        on this connection (a client pipelining), only close: the answers would interleave."""
        self._refused = True
        self._end_head()
        transport = self.transport
        if transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            body = orjson.dumps(error.payload())
            status = b"HTTP/1.1 %d %s\r\n" % (error.status, _REASONS[error.status])
            fields = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
            transport.write(status + fields + b"connection: close\r\n\r\n" + body)
        transport.close()


#: what the request line holds besides its target (the longest method, spaces, version, CRLF)
_REQUEST_LINE_BYTES = len(b"OPTIONS  HTTP/1.1\r\n")
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def bounded_head_protocol(max_head_bytes: int, head_timeout_s: float) -> type[BoundedHeadProtocol]:
    """The protocol class for a server with these limits (uvicorn makes one instance a connection)."""
    return type(
        "BoundedHeadProtocol",
        (BoundedHeadProtocol,),
        {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s},
    )
