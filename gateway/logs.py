"""Structured (one JSON object per line) logging; every record about a request carries its id."""

from __future__ import annotations

import logging
import sys
import time

import orjson

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("slogate")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class Repeated(logging.Filter):
    """Lets ``message`` through at most once every ``every_s`` seconds, the next one saying how
    many were held back: uvicorn warns of every request that is not HTTP, and a client sending
    garbage flooded the log with one line each."""

    def __init__(self, message: str, every_s: float = 60.0) -> None:
        super().__init__()
        self.message = message
        self.every_s = every_s
        self._last = -float("inf")
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.message:
            return True
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return False
        if self._held:
            record.msg, record.args = f"{self.message} ({self._held} more since the last said so)", ()
        self._last, self._held = now, 0
        return True


def quiet_repeats(logger: logging.Logger, message: str, every_s: float = 60.0) -> None:
    """Install :class:`Repeated` for ``message`` on ``logger`` once."""
    if not any(isinstance(f, Repeated) and f.message == message for f in logger.filters):
        logger.addFilter(Repeated(message, every_s))
