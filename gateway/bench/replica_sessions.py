"""The conversations part of ``slogate bench replicas``: whether a conversation's turns, spread
over the replicas as a Service spreads them, still find the engine that holds their history.

Each of ``sessions`` conversations sends ``turns`` turns one after the other (each turn's prompt is
the whole history so far: a long opening of its own, then each answer and a short question), turn
k of conversation s through replica (s + k) mod R, so consecutive turns of a conversation always
meet different replicas. The even conversations send ``x-session-id`` (session affinity and the
prefix index draw them); the odd ones send nothing of the kind, as most OpenAI SDK apps (only the
prefix index can). The gateways route with the shipped ``prefix-aware`` profile (prefix index and
session affinity under an imbalance guard, then least load). Measured per group over every turn
after a conversation's first:

- kept: the share that went to the engine of the conversation's previous turn;
- cached: the share of their prompt tokens the engine reported cached
  (``usage.prompt_tokens_details.cached_tokens``): the prefill the routing saved.

With one gateway (``single``) every dispatch is its own: the reference. With replicas that share
nothing (``memory``) a turn meets a replica that never saw the conversation, and goes where load
says. With a shared store (``redis``) each replica hears the others' dispatches
(:mod:`gateway.state.replica_routes`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

#: what a conversation opens with (eight times, after the run and conversation numbers): long
#: enough that its prefill matters (about 670 tokens as the simulated engine counts them)
_OPENING = (
    "I am planning meals for a family of four for the next two weeks, on a budget, with one "
    "vegetarian and one child who will not eat anything green. We cook on weekday evenings in "
    "under forty minutes and batch cook on Sundays. "
)
#: the question each later turn adds
_QUESTIONS = ("What about Tuesday?", "And a lunch box idea?", "Make it cheaper.", "Swap the fish.")


@dataclass(frozen=True, slots=True)
class SessionTurn:
    session: int
    turn: int
    engine: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class TurnFigures:
    #: turns after a conversation's first, answered (after an answered turn)
    later_turns: int
    #: of those, the share on the conversation's previous engine
    kept: float
    #: of their prompt tokens, the share the engines reported cached
    cached: float


@dataclass(frozen=True, slots=True)
class SessionFigures:
    #: conversations that sent ``x-session-id`` (the even ones)
    with_session: TurnFigures
    #: conversations that did not (the odd ones): only the prefix index draws their turns
    prompt_only: TurnFigures
    #: turns answered, and their mean prompt (tokens, as the engines counted them)
    answered: int
    mean_prompt_tokens: float
    #: conversations cut short by a failed turn
    errors: int
    #: the gateways' CPU per answered turn (every replica's, their idle CPU subtracted; set by
    #: the caller)
    cpu_ms_per_turn: float = 0.0

    @property
    def kept(self) -> float:
        """The lower of the two groups' kept shares."""
        return min(self.with_session.kept, self.prompt_only.kept)


def figures(turns: Sequence[SessionTurn]) -> TurnFigures:
    """Kept and cached shares over every answered turn after a conversation's first whose
    previous turn was answered too."""
    by_session: dict[int, dict[int, SessionTurn]] = {}
    for turn in turns:
        by_session.setdefault(turn.session, {})[turn.turn] = turn
    later = kept = prompt = cached = 0
    for answered in by_session.values():
        for k, turn in answered.items():
            previous = answered.get(k - 1)
            if previous is None:
                continue
            later += 1
            kept += turn.engine == previous.engine
            prompt += turn.prompt_tokens
            cached += turn.cached_tokens
    return TurnFigures(later, kept / later if later else 0.0, cached / prompt if prompt else 0.0)


def session_figures(turns: Sequence[SessionTurn], errors: int) -> SessionFigures:
    return SessionFigures(
        figures([t for t in turns if t.session % 2 == 0]),
        figures([t for t in turns if t.session % 2 == 1]),
        len(turns),
        sum(t.prompt_tokens for t in turns) / len(turns) if turns else 0.0,
        errors,
    )


def _usage(stream: bytes) -> tuple[int, int] | None:
    """Prompt and cached tokens from the stream's usage event (None without one)."""
    for line in stream.split(b"\n"):
        if not line.startswith(b"data: {") or b'"usage"' not in line:
            continue
        try:
            usage = orjson.loads(line[6:]).get("usage")
        except orjson.JSONDecodeError:
            continue
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            return usage["prompt_tokens"], cached if isinstance(cached, int) else 0
    return None


async def run_sessions(
    model: str,
    urls: Sequence[str],
    sessions: int,
    turns: int,
    tokens: int,
    run: str,
    timeout_s: float = 60.0,
) -> SessionFigures:
    """The conversations, ``sessions`` at once, through ``urls`` (see the module's docstring).
    ``run`` opens every prompt: runs on the same engines must differ, or one run's turns would
    find another's prompts cached."""
    answered: list[SessionTurn] = []
    errors = 0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:

        async def conversation(s: int) -> None:
            nonlocal errors
            await asyncio.sleep(0.02 * s)  # (staggered, as conversations begin)
            messages = [{"role": "user", "content": f"Run {run}, conversation {s}. " + _OPENING * 8}]
            # (the even conversations name themselves; the odd ones are matched by prompt alone)
            headers = {"Content-Type": "application/json"}
            if s % 2 == 0:
                headers["x-session-id"] = f"conversation-{s}"
            for k in range(turns):
                body = {
                    "model": model,
                    "messages": messages,
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                engine = ""
                stream = bytearray()
                try:
                    async with http.post(
                        urls[(s + k) % len(urls)] + "/v1/chat/completions",
                        data=orjson.dumps(body),
                        headers=headers,
                    ) as response:
                        engine = response.headers.get("x-slogate-engine", "")
                        async for chunk in response.content.iter_any():
                            stream += chunk
                        ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                usage = _usage(bytes(stream)) if ok else None
                if not ok or not engine or usage is None:
                    errors += 1
                    return  # (the rest of this conversation would not be comparable)
                answered.append(SessionTurn(s, k, engine, *usage))
                messages = [
                    *messages,
                    {"role": "assistant", "content": f"Here is plan {k} for conversation {s}."},
                    {"role": "user", "content": _QUESTIONS[k % len(_QUESTIONS)]},
                ]

        await asyncio.gather(*(conversation(s) for s in range(sessions)))
    return session_figures(answered, errors)
