"""What a migratable stream has relayed so far, kept cheaply so it can resume on another engine.

The collocated relay stays byte for byte: it never parses an event. For a stream that may migrate
(``migration_limit`` > 0, a streamed request that :func:`policies.migration.unsupported` accepts,
an engine that returns token ids) it hands each relayed chunk to :meth:`StreamLedger.feed`, which
keeps a reference to the first chunk (its id, ``created``, model and ``prompt_token_ids``) and
slices of the ``"token_ids":[...]`` arrays located with ``bytes.find``; nothing is decoded until a
migration needs it. The same object measures the stream's TPOT slack on its current engine
(Kairos eq. 2, :func:`policies.migration.tpot_slack`) and tells the relay when the slack trigger
should be consulted.

When the stream leaves its engine the relay returns a :class:`Cut` carrying why, and the
serving flow hands it to :mod:`gateway.serving.migration`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.sse import sse_data
from policies.migration import MigrationReason, tpot_slack

if TYPE_CHECKING:
    from gateway.api.errors import GatewayError
    from gateway.fleet.registry import EngineRecord

_TOKEN_IDS = b'"token_ids":['
_FINISHED = b'"finish_reason":"'
_FINISH_KEY = b'"finish_reason":'
#: deltas a chat server parses out of the output (a reasoning parser; tool calls): a resumed
#: stream is plain completions of the token ids and would carry them as text
_PARSED_DELTAS = (b'"reasoning_content":"', b'"reasoning":"', b'"tool_calls":[{')
PARSED_KEYS = ("reasoning_content", "reasoning", "tool_calls")
PARSED_OUTPUT = "the engine parses this stream's output (reasoning or tool calls)"
_MALFORMED = "a stream whose token ids the engine sent malformed"
#: token ids at or above this are no vocabulary's (and would not survive the next engine's JSON)
_TOKEN_ID_END = 1 << 31


def valid_token_ids(ids: object) -> bool:
    """Whether ``ids`` is a list of token ids an engine could be given back as a prompt."""
    return isinstance(ids, list) and all(type(i) is int and 0 <= i < _TOKEN_ID_END for i in ids)


#: how long after a slack check that did not move the stream the next one may come
SLACK_RECHECK_S = 0.25


class Cut:
    """A stream left its engine before ``[DONE]``: ``reason`` why, ``error`` what the client is
    told if it is not resumed (None for a slack move), ``placed`` the engine already reserved for
    it (a slack move reserves its target before it leaves the old engine)."""

    __slots__ = ("engine_id", "error", "placed", "reason")

    def __init__(
        self,
        reason: MigrationReason,
        engine_id: str,
        error: GatewayError | None,
        placed: EngineRecord | None = None,
    ) -> None:
        self.reason = reason
        self.engine_id = engine_id
        self.error = error
        self.placed = placed

    def __repr__(self) -> str:
        return f"Cut({self.reason.value}, {self.engine_id!r})"


class StreamLedger:
    """One stream's resumable state. ``blocked`` says why it cannot migrate (None: it can);
    a blocked ledger records nothing, so the relay can still say why when the engine fails."""

    __slots__ = (
        "blocked",
        "bound_s",
        "deadline",
        "finished",
        "first_chunk",
        "generated",
        "id_slices",
        "migrations",
        "mover",
        "n_here",
        "n_neg",
        "neg_since",
        "next_check",
        "prompt_ids",
        "resume",
        "stall_cut",
        "t_first",
        "tpot_s",
        "tracking",
        "visited",
    )

    def __init__(self, blocked: str | None = None) -> None:
        self.blocked = blocked
        #: the relay feeds this ledger (token ids are asked for and recorded)
        self.tracking = blocked is None
        self.first_chunk: bytes | None = None
        self.id_slices: list[bytes] = []
        self.generated: list[int] = []
        self.prompt_ids: list[int] | None = None
        #: a finish chunk (``finish_reason`` set) was relayed
        self.finished = False
        self.migrations = 0
        #: engines the stream left (a continuation goes to none of them)
        self.visited: list[str] = []
        #: what every continuation shares, made by the migration module at its first use
        self.resume: Any = None
        # slack on the current engine: target (0: not watched), first token there, tokens since
        self.tpot_s = 0.0
        self.bound_s = 0.0
        self.t_first = 0.0
        self.n_here = 0
        self.neg_since = 0.0
        self.n_neg = 0
        self.next_check = 0.0
        #: called when the slack trigger should be consulted: the engine reserved for the move,
        #: or None to stay
        self.mover: Callable[[], Awaitable[EngineRecord | None]] | None = None
        #: the relay's time limit while it waits for the first engine's next event (None while
        #: it sends to the client, or once it is done): moved to now to cut the stream at once
        #: when its engine is marked stalled (:meth:`cut_for_stall`)
        self.deadline: Any = None
        #: a cut for a stall was asked for (held back while the relay sends; undone by content)
        self.stall_cut = False

    # -- recording --------------------------------------------------------------------------------

    def feed(self, chunk: bytes, content: int, now: float) -> bool:
        """Record a relayed chunk of the first engine (raw SSE bytes, ``content`` events with
        output). True when the slack trigger should be consulted now."""
        if not self.tracking:
            return False
        if self.first_chunk is None and b"data:" in chunk:  # (not a keep-alive comment)
            self.first_chunk = chunk
        if any(delta in chunk for delta in _PARSED_DELTAS):
            self.blocked = PARSED_OUTPUT
            self.tracking = False
            return False
        if (_TOKEN_IDS not in chunk and b'"token_ids"' in chunk) or (
            _FINISH_KEY not in chunk and b'"finish_reason"' in chunk
        ):
            # JSON with spaces (a server or proxy that pretty-prints): the byte search would miss
            # the ids, and a resumed stream would repeat them
            if self._feed_decoded(chunk):
                return False
        else:
            find = chunk.find
            at = find(_TOKEN_IDS)
            while at >= 0:
                start = at + len(_TOKEN_IDS)
                end = find(b"]", start)
                if end < 0:
                    break
                if end > start:
                    self.id_slices.append(chunk[start:end])
                at = find(_TOKEN_IDS, end)
            if not self.finished and _FINISHED in chunk:
                self.finished = True
        return self.tick(content, now) if content and not self.finished else False

    def _feed_decoded(self, chunk: bytes) -> bool:
        """:meth:`feed`'s reading of ids and finish reasons, decoding each event; True when the
        stream turns out not to be resumable (its output parsed into reasoning or tool calls)."""
        for line in chunk.splitlines():
            payload = sse_data(line)
            if not payload.startswith(b"{"):
                continue
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            choices = event.get("choices") if isinstance(event, dict) else None
            for choice in choices if isinstance(choices, list) else ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                if isinstance(delta, dict) and any(delta.get(k) for k in PARSED_KEYS):
                    self.blocked = PARSED_OUTPUT
                    self.tracking = False
                    return True
                ids = choice.get("token_ids")
                if isinstance(ids, list) and ids:
                    self.id_slices.append(orjson.dumps(ids)[1:-1])
                if choice.get("finish_reason") is not None:
                    self.finished = True
        return False

    def extend(self, ids: list[int]) -> None:
        """Token ids of a resumed stream's chunk (already decoded by the migration relay)."""
        if self.id_slices:
            self._materialise()
        self.generated.extend(ids)

    def tokens(self) -> list[int]:
        """Every output token id relayed so far, in order."""
        if self.id_slices:
            self._materialise()
        return self.generated

    def _materialise(self) -> None:
        try:
            ids = orjson.loads(b"[" + b",".join(self.id_slices) + b"]")
        except orjson.JSONDecodeError:
            ids = None
        self.id_slices.clear()
        if not valid_token_ids(ids):
            # ("token_ids":[1,[2]] or ["a"]): what the client was sent has no ids to resume from,
            # and a continuation from the rest would repeat or lose tokens
            self.blocked = _MALFORMED
            self.tracking = False
            return
        self.generated.extend(ids)

    def first_event(self) -> dict[str, Any] | None:
        """The first relayed event, decoded (id, created, model, prompt ids); None if none came."""
        chunk = self.first_chunk
        if chunk is None:
            return None
        for event in chunk.replace(b"\r\n", b"\n").split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload.startswith(b"{"):
                        data = orjson.loads(payload)
                        if isinstance(data, dict):
                            return data
        return None

    # -- TPOT slack on the current engine ---------------------------------------------------------

    def watch_slack(
        self, tpot_s: float, bound_s: float, mover: Callable[[], Awaitable[EngineRecord | None]]
    ) -> None:
        self.tpot_s = tpot_s
        self.bound_s = bound_s
        self.mover = mover

    def on_new_engine(self) -> None:
        """The stream moved: its slack is measured afresh from its first token on the new engine."""
        self.t_first = 0.0
        self.n_here = 0
        self.neg_since = 0.0
        self.next_check = 0.0

    def tick(self, content: int, now: float) -> bool:
        """``content`` output events arrived at ``now``; True when the slack has been negative for
        the bound (and the last check is long enough ago)."""
        if self.tpot_s <= 0.0:
            return False
        if not self.t_first:
            self.t_first = now
            self.n_here = content - 1
            return False
        self.n_here += content
        if tpot_slack(self.tpot_s, self.n_here, now - self.t_first) >= 0.0:
            self.neg_since = 0.0
            return False
        if not self.neg_since:
            self.neg_since = now
            self.n_neg = self.n_here
            return False
        return now - self.neg_since >= self.bound_s and now >= self.next_check

    def observed_tpot(self, now: float) -> float:
        return (now - self.t_first) / self.n_here if self.t_first and self.n_here > 0 else 0.0

    def negative_for(self, now: float) -> float:
        return now - self.neg_since if self.neg_since else 0.0

    def recent_tpot(self, now: float) -> float | None:
        """Time per token since the slack turned negative (inf: none came since)."""
        if not self.neg_since:
            return None
        tokens = self.n_here - self.n_neg
        return (now - self.neg_since) / tokens if tokens > 0 else float("inf")

    async def move(self, now: float) -> EngineRecord | None:
        """Consult the slack trigger (see :attr:`mover`); None: stay, and check again later."""
        if self.mover is None:
            return None
        self.next_check = now + max(SLACK_RECHECK_S, self.bound_s / 2)
        return await self.mover()

    def cut_for_stall(self) -> bool:
        """End the wait for the stalled engine's next event now (the relay then returns a stall
        cut, and the stream is resumed elsewhere); a relay sending to its client is cut once
        that send is done. False when the stream cannot be resumed."""
        if not self.tracking:
            return False
        self.stall_cut = True
        deadline = self.deadline
        if deadline is not None:
            # (a limit that ran out just now: the stream is being cut already)
            with contextlib.suppress(RuntimeError):
                deadline.reschedule(asyncio.get_running_loop().time())
        return True

    def cut(
        self,
        reason: MigrationReason,
        engine_id: str,
        error: GatewayError | None,
        placed: EngineRecord | None = None,
    ) -> Cut:
        return Cut(reason, engine_id, error, placed)
