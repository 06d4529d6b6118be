"""Parsing large request bodies off the event loop.

``orjson.loads`` of a 15 MB body holds the event loop (and the GIL, so a thread would not help) for
13 ms (ASCII) to 34 ms (non-ASCII), and every stream relayed by this process stalls for as long.
Bodies above ``offload_parse_bytes`` are therefore parsed in a worker process, which sends back the
routing fields only; the proxy keeps the bytes it forwards and decodes them itself only in the rare
case a field must be removed for an engine. The worker starts with the first large body.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gateway.api.request_parse import ParsedRequest, RouteKind, parse_request, parse_summary


class BodyParser:
    """``parse_request`` that moves bodies over ``threshold`` bytes to a worker process."""

    def __init__(self, threshold: int, default_max_tokens: int) -> None:
        self.threshold = threshold
        self.default_max_tokens = default_max_tokens
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, kind: RouteKind, raw: bytes) -> ParsedRequest:
        if len(raw) <= self.threshold:
            return parse_request(kind, raw, self.default_max_tokens)
        if self._pool is None:
            # spawn, not fork: the gateway process runs threads (uvicorn, the tracer) and a loop
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        try:
            summary = await loop.run_in_executor(
                self._pool, parse_summary, kind, raw, self.default_max_tokens
            )
        except BrokenProcessPool:
            self._pool = None  # the worker died (e.g. killed): parse here, start a new one next time
            return parse_request(kind, raw, self.default_max_tokens)
        summary.raw = raw
        return summary

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
