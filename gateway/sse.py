"""Server-sent events as OpenAI-compatible servers write them."""

from __future__ import annotations


def sse_data(event: bytes) -> bytes:
    """An SSE event's data: after ``data:`` and the one space the spec lets a server put there or
    not (``data:{...}`` is as valid as ``data: {...}``), past any comment lines before it (a
    proxy's ``: ping``); the event itself when it has no data."""
    if event[:1] == b":":
        at = 0
        while event[at : at + 1] == b":":
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

    The boundary is a blank line, ``\\n\\n``; a server that ends its events with ``\\r\\n\\r\\n``
    is noticed at its first boundary. An event arriving over many reads is held as a list of
    those reads and only the newest read (with the three bytes before it, where a boundary may
    begin) is searched: joined and scanned once, not once per read (a 4 MB event in 4 KB reads
    was copied and scanned a thousand times).
    """

    __slots__ = ("held", "held_bytes", "limit", "sep", "tail")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sep = b"\n\n"
        #: the reads since the last boundary, and their length and last three bytes
        self.held: list[bytes] = []
        self.held_bytes = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, each ending with :attr:`sep` (b"": none yet).
        Raises :class:`OversizedEvent` once an event is longer than the limit."""
        sep = self.sep
        if not self.held:
            if chunk.endswith(sep):  # the common case: a read of whole events
                return chunk
            window, before = chunk, 0
        else:
            window = self.tail + chunk
            before = self.held_bytes - len(self.tail)
        end = window.rfind(sep)
        if end < 0 and sep == b"\n\n" and b"\r\n\r\n" in window:
            self.sep = sep = b"\r\n\r\n"
            end = window.rfind(sep)
        if end < 0:
            self.held.append(chunk)
            self.held_bytes += len(chunk)
            if self.held_bytes > self.limit:
                raise OversizedEvent(f"an SSE event past {self.limit} bytes")
            self.tail = (self.tail + chunk)[-3:]
            return b""
        end += before + len(sep)
        data = b"".join((*self.held, chunk)) if self.held else chunk
        if end == len(data):
            complete, rest = data, b""
        else:
            complete, rest = data[:end], data[end:]
        self.held = [rest] if rest else []
        self.held_bytes = len(rest)
        self.tail = rest[-3:]
        return complete
