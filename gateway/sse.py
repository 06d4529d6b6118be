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
