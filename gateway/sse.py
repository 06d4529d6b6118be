"""Server-sent events as OpenAI-compatible servers write them."""

from __future__ import annotations


def sse_data(event: bytes) -> bytes:
    """An SSE event's data: after ``data:`` and the one space the spec lets a server put there or
    not (``data:{...}`` is as valid as ``data: {...}``); the event itself when it has no data."""
    if event.startswith(b"data:"):
        return event[6:] if event[5:6] == b" " else event[5:]
    return event
