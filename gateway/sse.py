"""Server-sent events as OpenAI-compatible servers write them."""

from __future__ import annotations

#: what may come before an event's data line: comment lines, and blank lines' CR and LF
_SKIPPED = (b":", b"\r", b"\n")


def sse_data(event: bytes) -> bytes:
    """An SSE event's data: after ``data:`` and the one space the spec lets a server put there or
    not (``data:{...}`` is as valid as ``data: {...}``), past any comment lines before it (a
    proxy's ``: ping``) and blank lines (a proxy's LF event inside an engine's CRLF-framed
    stream is cut only at the next CRLF boundary: the ping, its blank line, then the event); the
    event itself when it has no data."""
    if event[:1] in _SKIPPED:
        at = 0
        while (first := event[at : at + 1]) in _SKIPPED:
            if first != b":":
                at += 1  # (a blank line's CR or LF)
                continue
            end = event.find(b"\n", at)
            if end < 0:
                return event  # comments only
            at = end + 1
        event = event[at:]
    if event.startswith(b"data:"):
        return event[6:] if event[5:6] == b" " else event[5:]
    return event


class OversizedEvent(Exception):
    """An engine's SSE event grew past the framer's limit without ending."""


class SseFramer:
    """Cuts an engine's reads at SSE event boundaries: :meth:`feed` returns the whole events a
    read completes, and holds the rest for the next read.

    The boundary is a blank line, ``\n\n``; a server that ends its events with ``\r\n\r\n``
    is noticed at its first such boundary. An event arriving over many reads is appended to one
    buffer, and only the newest read (with the three bytes before it, where a boundary may begin)
    is searched: each byte is copied and scanned about once, not once per read (a 4 MB event in
    4 KB reads was joined and rescanned a thousand times), and a buffer of the reads themselves
    would cost some 40 bytes a read (an engine writing two bytes at a time: 20 times the event).
    """

    __slots__ = ("held", "limit", "sep")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sep = b"\n\n"
        #: the bytes since the last boundary
        self.held = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, each ending with :attr:`sep` (b"": none yet).
        Raises :class:`OversizedEvent` once an event is longer than the limit."""
        sep = self.sep
        held = self.held
        if not held:
            if chunk.endswith(sep):  # the common case: a read of whole events
                return chunk
            window: bytes | bytearray = chunk
            before = 0
        else:
            window = held[-3:] + chunk
            before = len(held) - len(window) + len(chunk)
        end = window.rfind(sep)
        if end < 0 and sep == b"\n\n" and b"\r\n\r\n" in window:
            self.sep = sep = b"\r\n\r\n"
            end = window.rfind(sep)
        if end < 0:
            held += chunk
            if len(held) > self.limit:
                raise OversizedEvent(f"an SSE event past {self.limit} bytes")
            return b""
        end += before + len(sep)
        data = b"".join((held, chunk)) if held else chunk
        complete, rest = (data, b"") if end == len(data) else (data[:end], data[end:])
        if rest and sep == b"\n\n" and b"\r\n\r\n" in rest:
            # a server that ends its events with CRLF CRLF, after LF ones (a proxy's keep-alive):
            # the rest is not searched again, so its CRLF boundary is taken now
            self.sep = b"\r\n\r\n"
            cut = rest.rfind(b"\r\n\r\n") + 4
            complete, rest = data[: end + cut], rest[cut:]
        self.held = bytearray(rest)
        return complete
