"""The Responses API's own part: which engine holds a stored response, and the routes that read one.

``POST /v1/responses`` is placed, queued and relayed as a chat completion is (its events are
read by :func:`gateway.serving.relay._response_events`). What is its own is state on the engine:
an engine that stores its responses (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, SGLang, the
simulated engine) keeps each one, and a later request naming it as ``previous_response_id`` (or a
``GET`` / ``cancel`` of it) can be answered only there. So the gateway learns each stored
response's engine as it relays the answer (:class:`ResponseHomes`) and pins a continuation to it
(:attr:`policies.api.RequestView.engine`), planning its prompt with the conversation it carries.

An id the gateway has not seen (another replica served it, or this one restarted) is looked for
on the engines themselves, a ``GET`` to each at once: the one that answers 200 holds it. A
response the gateway knows is another tenant's is answered as unknown (a 404); one it does not
know is found for whoever asks first (its id, random and long, is what proves the asker's
claim, as it is at the engine).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.api.errors import GatewayError
from gateway.engines.base import read_up_to
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.serving.call import Call, Receive, Scope, Send

log = logging.getLogger("slogate.responses")

#: stored responses whose engines are remembered (an LRU: the oldest are looked for again)
MAX_HOMES = 100_000
#: how long the engines are given to say whether they hold an unknown response
LOOKUP_TIMEOUT_S = 2.0
#: the largest answer of a read of a stored response (its whole output)
MAX_ITEM_BYTES = 64 << 20
#: what a response id may be in a path (engines make ``resp_`` and 32 hex digits or the like)
_ITEM_PATH = re.compile(r"/v1/responses/([A-Za-z0-9_.:-]{1,256})(/cancel)?/?")


@dataclass(frozen=True, slots=True)
class Home:
    engine_id: str
    model: str
    tenant: str
    #: the conversation's tokens up to and with this response (its input and output): what a
    #: continuation's prompt carries before its own input
    tokens: int


class ResponseHomes:
    """Where each stored response lives, the most recent ``max_entries`` of them."""

    def __init__(self, max_entries: int = MAX_HOMES) -> None:
        self.max_entries = max_entries
        self._homes: collections.OrderedDict[str, Home] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, home: Home) -> None:
        self._homes[response_id] = home
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def get(self, response_id: str) -> Home | None:
        home = self._homes.get(response_id)
        if home is not None:
            self._homes.move_to_end(response_id)
        return home


class Responses:
    """Pins continuations to the engine of the response they continue, remembers where answers
    are stored, and serves ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""

    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self.fleet = fleet
        self.session = session
        #: bounds a read or cancel of a stored response (the engine answers from memory)
        self.timeout_s = timeout_s
        self.homes = ResponseHomes()

    # -- POST /v1/responses ------------------------------------------------------------------------

    async def pin(self, call: Call, tenant: str) -> None:
        """Pin a continuation (``previous_response_id``) to the engine that stored what it
        continues, and count that conversation in its prompt; a 404 when no engine has it, a
        503 when its engine is out of rotation for now."""
        request = call.request
        previous = request.previous_response
        if previous is None:
            return
        home = self.homes.get(previous)
        if home is not None and home.tenant != tenant:
            raise _not_found(previous)  # (another tenant's: as if it did not exist)
        if home is None:
            found = await self._look_for(previous, request.model)
            if found is None:
                raise _not_found(previous)
            home = Home(found.engine_id, found.model, tenant, 0)
            self.homes.remember(previous, home)
        record = self.fleet.records.get(home.engine_id)
        if record is None or record.model != request.model:
            raise _not_found(previous, f" (engine {home.engine_id} that stored it is gone)")
        if not (self.fleet.in_front(record) or self.fleet.in_decode_pool(record)):
            raise GatewayError(
                503,
                f"engine {home.engine_id}, which holds response {previous!r}, is out of rotation; "
                "retry later",
                code="engine_unavailable",
                retry_after_s=5.0,
            )
        call.pinned = home.engine_id
        request.prompt_tokens += home.tokens

    def finished(self, call: Call, status: int, tenant: str) -> None:
        """A Responses request ended (called before its usage is counted and cleared): where its
        answer is stored, if the engine keeps it."""
        request = call.request
        if status != 200 or not request.store or call.response_id is None or call.engine_id is None:
            return
        usage = call.usage or {}
        tokens = _count(usage.get("prompt_tokens")) + _count(usage.get("completion_tokens"))
        self.homes.remember(call.response_id, Home(call.engine_id, request.model, tenant, tokens))

    # -- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel ----------------------------------

    async def handle_item(self, scope: Scope, receive: Receive, send: Send, tenant: str) -> int:
        """Relay a read or cancel of a stored response to its engine; returns the status sent."""
        matched = _ITEM_PATH.fullmatch(scope["path"])
        if matched is None:
            raise GatewayError(404, f"no such route: {scope['path'][:200]}", code="not_found")
        response_id, cancel = matched.group(1), matched.group(2) is not None
        method = scope["method"]
        if method != ("POST" if cancel else "GET"):
            refused = GatewayError(
                405,
                f"{scope['path'][:200]} accepts {'POST' if cancel else 'GET'} only",
                code="method_not_allowed",
            )
            refused.extra_headers = ((b"allow", b"POST" if cancel else b"GET"),)
            raise refused
        home = self.homes.get(response_id)
        if home is not None and home.tenant != tenant:
            raise _not_found(response_id)  # (another tenant's: as if it did not exist)
        record = None if home is None else self.fleet.records.get(home.engine_id)
        if record is None:
            record = await self._look_for(response_id, None)
            if record is None:
                raise _not_found(response_id)
            self.homes.remember(response_id, Home(record.engine_id, record.model, tenant, 0))
        if b"stream=true" in scope.get("query_string", b"").lower():
            # (replaying a stored response's events is for background responses, which the
            # gateway does not take: see gateway/api/request_parse.py)
            raise GatewayError(400, "streaming a stored response is not supported", param="stream")
        path = f"/v1/responses/{response_id}" + ("/cancel" if cancel else "")
        url = record.adapter.url(path)
        headers = record.adapter.upstream_headers(f"read-{response_id}")
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.request(method, url, headers=headers) as answer:
                    body, whole = await read_up_to(answer, MAX_ITEM_BYTES)
                    status, kind = answer.status, answer.content_type
                    if status == 200 and kind != "application/json":
                        raise aiohttp.ContentTypeError(answer.request_info, (), message=f"a {kind} answer")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GatewayError(
                502,
                f"engine {record.engine_id} did not answer for response {response_id!r}: {exc!r}"[:500],
                code="upstream_failed",
            ) from None
        if not whole:
            raise GatewayError(502, f"engine {record.engine_id} answered too much", code="upstream_too_large")
        if status >= 400 and kind != "application/json":
            raise GatewayError(
                status if status < 600 else 502, f"engine {record.engine_id} answered HTTP {status}"
            )
        start = {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"x-slogate-engine", record.engine_id.encode()),
            ],
        }
        async with asyncio.timeout(self.timeout_s):  # (a client that takes nothing is gone)
            await send(start)
            await send({"type": "http.response.body", "body": body})
        return status

    # -- finding an unknown response -------------------------------------------------------------

    async def _look_for(self, response_id: str, model: str | None) -> EngineRecord | None:
        """The engine (of ``model``, or any) that answers a read of the response with a 200."""
        records = [
            # (a draining engine still holds what it stored)
            r
            for r in self.fleet.records.values()
            if (model is None or r.model == model) and r.healthy
        ]
        if not records:
            return None

        async def holds(record: EngineRecord) -> bool:
            url = record.adapter.url(f"/v1/responses/{response_id}")
            headers = record.adapter.upstream_headers(f"find-{response_id}")
            try:
                async with self.session.get(url, headers=headers) as answer:
                    return answer.status == 200
            except aiohttp.ClientError:
                return False

        tasks = {asyncio.ensure_future(holds(r)): r for r in records}
        try:
            deadline = time.monotonic() + LOOKUP_TIMEOUT_S
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending,
                    timeout=max(0.0, deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    return None
                for task in done:
                    if not task.cancelled() and task.exception() is None and task.result():
                        return tasks[task]
            return None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _not_found(response_id: str, why: str = "") -> GatewayError:
    return GatewayError(
        404,
        f"Response with id {response_id[:256]!r} not found{why}.",
        param="previous_response_id",
        code="response_not_found",
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
