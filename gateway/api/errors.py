"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

# OpenAI's error ``type`` for each status the gateway produces itself.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",  # (a conflict with the gateway's state: the caller's to resolve)
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error answered to the client as OpenAI-shaped JSON (or an SSE error event mid-stream)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        #: further response headers (e.g. an auth challenge)
        self.extra_headers: tuple[tuple[bytes, bytes], ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        # picklable with every attribute, subclasses included (a parse error raised in a worker
        # process comes back whole)
        return (_rebuild, (type(self), self.message), dict(self.__dict__))

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers the error needs: JSON, and ``Retry-After`` when retrying makes sense."""
        out = [(b"content-type", b"application/json")]
        if self.retry_after_s is not None:
            out.append((b"retry-after", b"%d" % max(1, round(self.retry_after_s))))
        out.extend(self.extra_headers)
        return out

    def payload(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def sse_event(self) -> bytes:
        """The error as one SSE event, for failures after the first byte was sent."""
        return b"data: " + self.body() + b"\n\n"


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


async def send_error(
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    error: GatewayError,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer ``error`` on a raw ASGI ``send`` (the data routes and the auth guard)."""
    body = error.body()
    # (with its length: a client reading one answer on a kept connection knows where it ends,
    # without chunked framing)
    length = (b"content-length", b"%d" % len(body))
    headers = [*error.headers(), length, *extra]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _rebuild(cls: type[GatewayError], message: str) -> GatewayError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


def described(value: object) -> str:
    """A client's value as an error message may show it: a number, a boolean or null as JSON
    says it, a string's first characters, anything else by its JSON type only (a whole value
    echoed back was up to 2.5x the body again, and repr() of one nested 1,000 deep raised)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= 40 else f"a number of {len(text)} digits"
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, dict):
        return "an object"
    return "an array" if isinstance(value, list) else type(value).__name__


def encode_body(body: object) -> bytes:
    """``body`` (a client's, edited for an engine) as JSON again; a 400 when it nests deeper
    than orjson writes (254 levels; it reads up to 1,024)."""
    try:
        return orjson.dumps(body)
    except TypeError:  # (orjson.JSONEncodeError is one)
        raise bad_request(
            "the request body nests too deeply to be forwarded (more than 254 levels)"
        ) from None
