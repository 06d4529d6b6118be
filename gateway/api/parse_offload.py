"""Parsing large request bodies off the event loop.

``orjson.loads`` of a 15 MB body holds the event loop (and the GIL, so a thread would not help) for
13 ms (ASCII) to 34 ms (non-ASCII), and every stream relayed by this process stalls for as long.
Bodies above ``offload_parse_bytes`` are therefore parsed in a worker process, which sends back the
routing fields only; the proxy keeps the bytes it forwards and decodes them itself only in the rare
case a field must be removed for an engine.

The worker starts with the first large body, and until it is up (a process spawn and the
gateway's imports: about a second here, many on a loaded machine) large bodies are parsed in
place: a stall of tens of milliseconds for the other streams rather than a second or more of
waiting for the body's own request. A gateway that never sees a large body starts no worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gateway import metrics
from gateway.api.request_parse import ParsedRequest, RouteKind, parse_request, parse_summary
from gateway.procs import die_with_parent

log = logging.getLogger("slogate.parse")

#: worker deaths in a row (no body parsed between them) after which bodies are parsed in place
MAX_DEATHS = 3
#: bodies the worker keys at once with an engine's tokenizer (it parses one body at a time): one
#: takes up to seconds, and the bodies queued behind a burst of them waited for every one before
#: their routing fields came back; past it a body is parsed without its key (routed without
#: prefix credit and counted, as the front door's keyer does when its queue is full). The
#: gateway's own encoder takes milliseconds: without engine tokenizers, every body is keyed
MAX_KEYING = 1


def _worker_init(parent: int) -> None:
    # Ctrl-C goes to the whole process group: the gateway shuts its worker down, quietly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # and a gateway killed outright (SIGKILL, the OOM killer) takes its worker with it; one
    # killed while the worker was still starting is gone already
    die_with_parent(parent)


class BodyParser:
    """``parse_request`` that moves bodies over ``threshold`` bytes to a worker process.

    Where worker processes cannot be made (no ``/dev/shm``, no ``sem_open``), or the worker keeps
    dying (``MAX_DEATHS`` times in a row without a body parsed), bodies are parsed in place:
    slower for other streams, never an error for the client. A worker that died is replaced by
    the next large body, whether it died during a parse or while idle.
    """

    def __init__(
        self,
        threshold: int,
        default_max_tokens: int,
        prompt_ids: bool = False,
        engine_tokenizers: Mapping[str, str] | None = None,
    ) -> None:
        self.threshold = threshold
        self.default_max_tokens = default_max_tokens
        #: the worker also computes the prompt's token ids (for the prefix index)
        self.prompt_ids = prompt_ids
        #: model -> tokenizer directory: those models' prompts are keyed with their own tokenizer
        self.engine_tokenizers = dict(engine_tokenizers or {})
        self._pool: ProcessPoolExecutor | None = None
        #: the pool's first task, a no-op: done once its worker is up
        self._warm_up: concurrent.futures.Future[int] | None = None
        self._disabled = False
        self._deaths = 0  # in a row, without a body parsed since
        self._keying = 0  # bodies sent to the worker with their key to compute

    async def parse(
        self, kind: RouteKind, raw: bytes, engine_tokenizers: Mapping[str, str] | None = None
    ) -> ParsedRequest:
        """``engine_tokenizers`` (the worker's model -> tokenizer directory) replaces the parser's
        own for this body when given."""
        if len(raw) <= self.threshold or self._disabled:
            return parse_request(kind, raw, self.default_max_tokens)
        try:
            pool = self._pool
            if pool is None:
                # spawn, not fork: the gateway process runs threads (uvicorn, the tracer) and a loop
                pool = self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_init,
                    initargs=(os.getpid(),),
                )
                self._warm_up = pool.submit(os.getpid)
            warm_up = self._warm_up
            if warm_up is not None and not warm_up.done():
                return parse_request(kind, raw, self.default_max_tokens)  # (the worker is starting)
            if warm_up is not None and warm_up.exception() is not None:
                self._died(pool)  # it died starting: the next large body starts another
                return parse_request(kind, raw, self.default_max_tokens)
            tokenizers = self.engine_tokenizers if engine_tokenizers is None else engine_tokenizers
            keyed = self.prompt_ids and (not tokenizers or self._keying < MAX_KEYING)
            if self.prompt_ids and not keyed:
                metrics.PREFIX_KEYS_SKIPPED.inc()
            future = asyncio.get_running_loop().run_in_executor(
                pool,
                parse_summary,
                kind,
                raw,
                self.default_max_tokens,
                keyed,
                tokenizers,
            )
        except BrokenProcessPool:
            # (a RuntimeError too: the worker died while idle, and only a submit says so)
            self._died(pool)
            return parse_request(kind, raw, self.default_max_tokens)
        except (OSError, NotImplementedError, RuntimeError) as exc:
            log.warning("no worker process for large bodies (%s); parsing them in place", exc)
            self._disabled = True
            return parse_request(kind, raw, self.default_max_tokens)
        self._keying += keyed
        try:
            summary = await future
        except BrokenProcessPool:
            self._died(pool)
            return parse_request(kind, raw, self.default_max_tokens)
        finally:
            self._keying -= keyed
        self._deaths = 0
        summary.raw = raw
        return summary

    def _died(self, pool: ProcessPoolExecutor | None) -> None:
        """``pool``'s worker died: counted once per pool, however many bodies were queued on it
        (each is told so), and never shutting down a pool started since."""
        if pool is None or self._pool is not pool:
            return
        self._pool = self._warm_up = None
        pool.shutdown(wait=False, cancel_futures=True)
        metrics.PARSE_WORKER_FAILURES.inc()
        self._deaths += 1
        if self._deaths >= MAX_DEATHS:
            log.warning("the body-parsing worker died %d times in a row; parsing in place", self._deaths)
            self._disabled = True
        else:
            log.warning("the body-parsing worker died; a new one starts with the next large body")

    async def started(self) -> bool:
        """Wait until the worker the first large body started is up (tests; the gateway never
        waits for it). False when there is none or it died starting."""
        if self._warm_up is None:
            return False
        try:
            await asyncio.wrap_future(self._warm_up)
        except BrokenProcessPool:
            return False
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._warm_up = None
