"""The Responses API's own part: which engine holds a stored response, and the routes that read one.

``POST /v1/responses`` is placed, queued and relayed as a chat completion is (its events are
read by :func:`gateway.serving.relay._response_events`). What is its own is state on the engine:
an engine that stores its responses (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, SGLang, the
simulated engine) keeps each one, and a later request naming it as ``previous_response_id`` (or a
``GET`` / ``cancel`` of it) can be answered only there. So the gateway learns each stored
response's engine as it relays the answer (:class:`ResponseHomes`) and pins a continuation to it
(:attr:`policies.api.RequestView.engine`), planning its prompt with the conversation it carries.

Replicas sharing a state store (Redis) share these homes. An id the gateway has not seen (another
replica served it without a shared store, or this one restarted) is looked for on the engines
themselves, a ``GET`` to each at once: the one that answers 200 holds it. A
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
from urllib.parse import parse_qs, quote

import aiohttp
import orjson

from gateway.api.errors import GatewayError
from gateway.api.request_parse import RESPONSE_ID
from gateway.engines.base import json_object, read_up_to
from gateway.fleet.registry import EngineRecord, Fleet
from gateway.serving.call import Call, Receive, Scope, Send
from gateway.serving.relay import upstream_error
from gateway.state.store import StateStore, StoreError

log = logging.getLogger("slogate.responses")

#: stored responses whose engines are remembered (an LRU: the oldest are looked for again)
MAX_HOMES = 100_000
#: how long the shared store keeps where a response is stored (engines keep theirs in memory,
#: until they restart)
HOME_TTL_S = 24 * 3600.0
#: a found response's answer is read for its usage only this long, and this far (its length)
TOKENS_READ_S = 0.5
TOKENS_READ_BYTES = 1 << 20
#: how long the engines are given to say whether they hold an unknown response
LOOKUP_TIMEOUT_S = 2.0
#: the largest answer of a read of a stored response (its whole output)
MAX_ITEM_BYTES = 16 << 20
#: a stored response's routes: its id as a previous_response_id may be (RESPONSE_ID)
_ITEM_PATH = re.compile(rf"/v1/responses/({RESPONSE_ID.pattern})(/cancel)?/?")


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
    are stored, and serves ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

    With a shared ``store`` (gateway replicas over Redis) every replica writes where its answers
    are stored, and reads there what it does not know before asking the engines: a continuation
    through another replica goes to its engine at once, and stays its tenant's."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        timeout_s: float,
        client_timeout_s: float,
        store: StateStore | None = None,
        namespace: str = "slogate",
    ) -> None:
        self.fleet = fleet
        self.session = session
        #: bounds a read or cancel of a stored response at its engine (answered from memory)
        self.timeout_s = timeout_s
        #: ...and the client's taking of the answer
        self.client_timeout_s = client_timeout_s
        self.homes = ResponseHomes()
        self.store = store
        self._key_prefix = f"{{{namespace}}}:response:"
        #: writes to the store under way (kept: a task nothing holds may be collected mid-way)
        self._writes: set[asyncio.Task[None]] = set()

    # -- POST /v1/responses ------------------------------------------------------------------------

    async def pin(self, call: Call, tenant: str) -> None:
        """Pin a continuation (``previous_response_id``) to the engine that stored what it
        continues, and count that conversation in its prompt; a 404 when no engine has it, a
        503 when its engine is out of rotation for now."""
        request = call.request
        previous = request.previous_response
        if previous is None:
            return
        home = await self._home(previous)
        if home is not None and home.tenant != tenant:
            raise _not_found(previous, "previous_response_id")  # (another tenant's: as if unknown)
        if home is None or home.engine_id not in self.fleet.records:
            # (unknown here, or known by an engine id this replica does not have: another
            # replica's configuration names it otherwise, or it left the fleet). Remembered by
            # this replica only: only the replica that served an answer writes where it is, so
            # what another asks cannot overwrite its tenant
            found, tokens = await self._find(previous, request.model, "previous_response_id")
            home = Home(found.engine_id, found.model, tenant, tokens)
            self.homes.remember(previous, home)
        record = self.fleet.records[home.engine_id]
        if record.model != request.model:
            raise GatewayError(
                400,
                f"response {previous!r} was made by model {record.model!r}; a continuation of it "
                f"must name that model, not {request.model!r}",
                param="model",
                code="model_mismatch",
            )
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
        known = self.homes.get(call.response_id)
        if known is not None and known.tenant != tenant:
            return  # (an engine that reuses ids must not hand one tenant's to another)
        usage = call.usage or {}
        tokens = _count(usage.get("prompt_tokens")) + _count(usage.get("completion_tokens"))
        self._remember(call.response_id, Home(call.engine_id, request.model, tenant, tokens))

    def _remember(self, response_id: str, home: Home) -> None:
        self.homes.remember(response_id, home)
        if self.store is None:
            return
        value = orjson.dumps({"e": home.engine_id, "m": home.model, "t": home.tenant, "k": home.tokens})
        task = asyncio.get_running_loop().create_task(self._write(response_id, value))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, response_id: str, value: bytes) -> None:
        assert self.store is not None
        try:
            await self.store.put(self._key_prefix + response_id, value, HOME_TTL_S)
        except StoreError as exc:  # (a replica that asks later looks on the engines instead)
            log.debug("response %s not written to the state store: %s", response_id, exc)

    async def _home(self, response_id: str) -> Home | None:
        """Where the response is stored: as this replica knows it, else as the shared store does."""
        home = self.homes.get(response_id)
        if home is not None or self.store is None:
            return home
        try:
            (value,) = await self.store.get_many([self._key_prefix + response_id])
        except StoreError as exc:
            log.debug("response %s not read from the state store: %s", response_id, exc)
            return None
        home = _decoded_home(value)
        if home is not None:
            self.homes.remember(response_id, home)
        return home

    async def close(self) -> None:
        """Wait for the store writes under way (bounded by the store's own timeout)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    # -- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel ----------------------------------

    async def handle_item(self, scope: Scope, receive: Receive, send: Send, tenant: str) -> int:
        """Relay a read or cancel of a stored response to its engine; returns the status sent."""
        matched = _ITEM_PATH.fullmatch(scope["path"])
        if matched is None:
            raise GatewayError(404, f"no such route: {scope['path'][:200]!r}", code="not_found")
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
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if any(v.lower() not in ("false", "0", "") for v in query.get("stream", ())):
            # (replaying a stored response's events is for background responses, which the
            # gateway does not take: see gateway/api/request_parse.py)
            raise GatewayError(400, "streaming a stored response is not supported", param="stream")
        home = await self._home(response_id)
        if home is not None and home.tenant != tenant:
            raise _not_found(response_id, "response_id")  # (another tenant's: as if unknown)
        record = None if home is None else self.fleet.records.get(home.engine_id)
        if record is None:
            record, tokens = await self._find(response_id, None, "response_id")
            self.homes.remember(
                response_id, Home(record.engine_id, record.model, tenant, tokens)
            )  # (as in pin)
        path = f"/v1/responses/{quote(response_id, safe='')}" + ("/cancel" if cancel else "")
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
        if status in (401, 403):
            # (the engine refuses the gateway's own credentials: not the client's key)
            raise GatewayError(
                502,
                f"engine {record.engine_id} refused the gateway's credentials",
                code="upstream_auth_failed",
            )
        if status != 200:
            # (said as an OpenAI error whatever the engine wrote: its JSON error, a framework's
            # {"detail": ...}, a page)
            error = upstream_error(status, body)
            if status == 404:
                error.param, error.code = "response_id", "response_not_found"
            raise error
        start = {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"x-slogate-engine", record.engine_id.encode()),
            ],
        }
        async with asyncio.timeout(self.client_timeout_s):  # (a client that takes nothing is gone)
            await send(start)
            await send({"type": "http.response.body", "body": body})
        return status

    # -- finding an unknown response -------------------------------------------------------------

    async def _find(self, response_id: str, model: str | None, param: str) -> tuple[EngineRecord, int]:
        """The engine (of ``model``, or any) that answers a read of the response with a 200, and
        the conversation's tokens its answer tells (its usage): a 404 when every engine that
        could hold it said it does not, a 503 when one could not tell (it did not answer in time,
        failed, or is out of rotation: the response may be there)."""
        records = [r for r in self.fleet.records.values() if model is None or r.model == model]
        # (a draining engine still holds what it stored; an unhealthy one cannot be asked)
        asked = [r for r in records if r.healthy]
        unsure = len(asked) < len(records)
        loop = asyncio.get_running_loop()

        async def holds(record: EngineRecord) -> tuple[bool | None, int]:
            url = record.adapter.url(f"/v1/responses/{quote(response_id, safe='')}")
            headers = record.adapter.upstream_headers(f"find-{response_id}")
            try:
                async with self.session.get(url, headers=headers) as answer:
                    if answer.status != 200:
                        return (False if answer.status == 404 else None), 0
                    # it holds it; how long the conversation is, only if its answer says so soon
                    try:
                        async with asyncio.timeout(TOKENS_READ_S):
                            body, whole = await read_up_to(answer, TOKENS_READ_BYTES)
                    except (aiohttp.ClientError, TimeoutError):
                        return True, 0
                    return True, _conversation_tokens(body) if whole else 0
            except (aiohttp.ClientError, OSError):
                return None, 0

        tasks = {loop.create_task(holds(r)): r for r in asked}
        try:
            deadline = time.monotonic() + LOOKUP_TIMEOUT_S
            pending = set(tasks)
            while pending:
                left = max(0.0, deadline - time.monotonic())
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    unsure = True  # (some did not answer in time)
                    break
                for task in done:
                    verdict, tokens = (
                        (None, 0) if task.cancelled() or task.exception() is not None else task.result()
                    )
                    if verdict:
                        return tasks[task], tokens
                    unsure = unsure or verdict is None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if unsure:
            raise GatewayError(
                503,
                f"response {response_id!r} could not be looked for on every engine that may hold it; "
                "retry later",
                code="engine_unavailable",
                retry_after_s=2.0,
            )
        raise _not_found(response_id, param)


def _not_found(response_id: str, param: str, why: str = "") -> GatewayError:
    return GatewayError(
        404, f"Response with id {response_id[:256]!r} not found{why}.", param=param, code="response_not_found"
    )


def _conversation_tokens(body: bytes) -> int:
    """A stored response's input and output tokens, from its usage (0 when it tells none)."""
    usage = (json_object(body) or {}).get("usage")
    if not isinstance(usage, dict):
        return 0
    return _count(usage.get("input_tokens")) + _count(usage.get("output_tokens"))


def _decoded_home(value: bytes | None) -> Home | None:
    """A home as the store holds it (written by any replica, of any version: what is not one is
    none)."""
    data = None if value is None else json_object(value)
    if data is None:
        return None
    engine, model, tenant, tokens = data.get("e"), data.get("m"), data.get("t"), data.get("k")
    if not (isinstance(engine, str) and isinstance(model, str) and isinstance(tenant, str)):
        return None
    return Home(engine, model, tenant, _count(tokens))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
