"""Decode migration: when a running stream should be resumed on another engine.

Pure decisions, no I/O, no clock, no gateway imports. The gateway's mechanism
(``gateway/serving/migration.py``) re-issues the prompt plus the tokens relayed so far to another
engine with the remaining budget (as Dynamo's ``--migration-limit`` does after a worker dies) and
asks these functions three things:

* :func:`unsupported` - can this request be resumed at all? Guided decoding (an FSM whose state
  cannot move with the tokens), ``n > 1`` or beam search (several sequences), log-probabilities
  (the continuation's would come in the completions shape and the earlier ones cannot be
  re-derived) and text stop strings (a stop string may span the boundary, and text held back by
  the first engine is never sent) are not: a cut ends with a clear error instead of a wrong answer.
* :func:`decide_on_failure` - the engine failed mid-stream (connection cut, crash, stall): always
  resume, within the request's migration limit.
* :func:`decide_on_slack` - the HyperFlexis Migrator's trigger with Kairos' TPOT slack (§3.2,
  eq. 2): the stream's slack on its current engine, ``tpot_target * (n + 1) - elapsed`` (``n``
  tokens since its first token there), has stayed negative for ``slack_bound_s`` and is still
  falling (the pace since it turned negative is slower than the target: a stream that is paying
  back a transient stall, such as a burst of prefills on its engine, stays), enough tokens remain,
  and another engine has room and is predicted to decode the rest faster by more than the
  re-prefill (its queued prompts included) costs. The slack is measured per engine, from the
  stream's first token on it, so a stream resumed on a fast engine does not carry the slow
  engine's debt into another move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class MigrationReason(StrEnum):
    """Why a stream left its engine (the ``reason`` label of ``slogate_migrations_total``)."""

    #: the connection was cut or the stream ended before it was complete (crash, kill, network)
    FAILURE = "failure"
    #: the engine sent nothing for the idle limit after the stream had started
    STALL = "stall"
    #: TPOT slack negative past the bound while another engine had room
    SLACK = "slack"


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """``limit``: migrations allowed per request (0: never). ``slack``: whether slack may move a
    healthy stream at all. ``slack_bound_s``: how long the slack must stay negative.
    ``min_remaining_tokens``: a stream this close to its budget is left where it is.
    ``target_margin``: a target's predicted TPOT must be at most this share of the SLO target."""

    limit: int = 0
    slack: bool = True
    slack_bound_s: float = 1.0
    min_remaining_tokens: int = 16
    target_margin: float = 0.8


@dataclass(frozen=True, slots=True)
class StreamView:
    """One running stream as the trigger sees it.

    ``migrations``: moves so far. ``remaining_tokens``: output budget left (``max_tokens`` less the
    tokens relayed). ``tpot_target_s``: the request's TPOT objective. ``observed_tpot_s``: mean time
    per token on the current engine since its first token there. ``negative_for_s``: how long the
    slack has been negative without a break (0 when it is not). ``recent_tpot_s``: time per token
    since the slack turned negative (``inf`` when no token came since; None: not measured).
    """

    migrations: int
    remaining_tokens: int
    tpot_target_s: float
    observed_tpot_s: float = 0.0
    negative_for_s: float = 0.0
    recent_tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """An engine the stream could move to. ``has_room``: below the load cap with KV for the whole
    resumed request. ``predicted_tpot_s``: its decode step with this stream added.
    ``resume_s``: its predicted re-prefill of prompt + tokens so far."""

    engine_id: str
    has_room: bool
    predicted_tpot_s: float
    resume_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """``migrate``: move now. ``targets``: acceptable engines, best first (empty: any engine the
    dispatcher picks). ``why``: a short reason, for logs and error events."""

    migrate: bool
    reason: MigrationReason | None = None
    targets: tuple[str, ...] = ()
    why: str = ""


#: fields that put an FSM (guided decoding, structured output) between the model and its tokens
_GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "regex",
    "ebnf",
)


#: every body field :func:`unsupported` reads (a body with none of them is resumable as it is)
UNSUPPORTED_FIELDS = frozenset(
    (
        "n",
        "best_of",
        "use_beam_search",
        *_GUIDED_FIELDS,
        "response_format",
        "tools",
        "tool_choice",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "stop",
    )
)


def batched_prompts(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds: a list of strings or of token-id lists is
    a batch (one choice each); a string or one list of token ids is one prompt."""
    if isinstance(prompt, list) and len(prompt) > 1 and any(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def batch_reason(prompts: int) -> str:
    return f"a batch of {prompts} prompts (several sequences cannot be resumed as one)"


def more_than_one(value: Any) -> bool:
    """A count field (``n``, ``best_of``) asking for several: an engine's JSON model (pydantic,
    lax) takes 2.0 as 2, and "2" too."""
    if isinstance(value, str) and len(value) <= 64:
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 1


def unsupported(body: Mapping[str, Any]) -> str | None:
    """Why a request cannot be resumed on another engine with the same result; None when it can.

    ``body`` is the client's request body (chat or completions).
    """
    n = body.get("n")
    if more_than_one(n):
        return f"n = {n} (several sequences cannot be resumed as one)"
    batch = batched_prompts(body.get("prompt"))
    if batch > 1:
        return batch_reason(batch)
    best_of = body.get("best_of")
    if more_than_one(best_of):
        return f"best_of = {best_of}"
    if body.get("use_beam_search"):
        return "beam search"
    for name in _GUIDED_FIELDS:
        if body.get(name) is not None:
            return f"guided decoding ({name})"
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind not in (None, "text"):
            return f"guided decoding (response_format {kind})"
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools and (choice == "required" or isinstance(choice, Mapping)):
        return "guided decoding (tool_choice forces a tool call)"
    if tools and choice != "none":
        # the engine parses tool calls out of the chat stream; a continuation (plain completions
        # of the token ids) and a restart's re-shaped events carry text only
        return "tool calls (a resumed stream carries text only)"
    logprobs = body.get("logprobs")  # chat: a boolean; completions: a count, 0 included
    if (
        (logprobs is not None and logprobs is not False)
        or body.get("top_logprobs")
        or body.get("prompt_logprobs") is not None
    ):
        return "log-probabilities"
    stop = body.get("stop")
    if stop:
        return "text stop strings"
    for name in _OUTPUT_PENALTIES:
        value = body.get(name)
        if value is not None and value is not False and value != 0:
            # they weigh the tokens generated so far; resumed, those are prompt tokens, which
            # these do not weigh: the continuation's logits differ, and the repetition they
            # held back comes back
            return f"{name} (it weighs the output so far, which a resumed stream sends as prompt)"
    return None


#: sampling penalties vLLM computes over the output tokens only (its repetition_penalty weighs
#: the prompt's too: resumed, the same tokens are weighed the same)
_OUTPUT_PENALTIES = ("frequency_penalty", "presence_penalty")


def tpot_slack(tpot_target_s: float, tokens_after_first: int, elapsed_s: float) -> float:
    """Kairos eq. 2 at the gateway: time left before the next token is due if every token after
    the first must come within ``tpot_target_s``; negative: the stream is behind its TPOT pace."""
    return tpot_target_s * (tokens_after_first + 1) - elapsed_s


def decide_on_failure(
    stream: StreamView,
    settings: MigrationSettings,
    reason: MigrationReason,
    blocked: str | None = None,
    resumable: bool = True,
) -> Decision:
    """The engine failed under a started stream: resume it elsewhere unless the request cannot be
    resumed (``blocked``, from :func:`unsupported`), nothing was relayed to resume from
    (``resumable`` False) or it has used its migrations."""
    if settings.limit <= 0:
        return Decision(False, reason, why="migration is off")
    if blocked is not None:
        return Decision(False, reason, why=f"not migrated: {blocked} cannot be resumed on another engine")
    if not resumable:
        return Decision(False, reason, why="not migrated: the engine returned no token ids to resume from")
    if stream.migrations >= settings.limit:
        return Decision(False, reason, why=f"not migrated: migration limit ({settings.limit}) reached")
    return Decision(True, reason, why=f"engine {reason.value}")


def decide_on_slack(
    stream: StreamView, candidates: Sequence[Candidate], settings: MigrationSettings
) -> Decision:
    """Move a healthy but slow stream? Only when its slack stayed negative past the bound, enough
    tokens remain to pay for the re-prefill, and an engine with room beats the target pace."""
    if settings.limit <= 0 or not settings.slack:
        return Decision(False, MigrationReason.SLACK, why="slack migration is off")
    if stream.migrations >= settings.limit:
        return Decision(False, MigrationReason.SLACK, why="migration limit reached")
    if stream.negative_for_s < settings.slack_bound_s:
        return Decision(False, MigrationReason.SLACK, why="slack not negative for long enough")
    if stream.remaining_tokens < max(1, settings.min_remaining_tokens):
        return Decision(False, MigrationReason.SLACK, why="too few tokens left")
    if stream.observed_tpot_s <= stream.tpot_target_s:
        return Decision(False, MigrationReason.SLACK, why="the stream keeps its TPOT pace")
    if stream.recent_tpot_s is not None and stream.recent_tpot_s <= stream.tpot_target_s:
        return Decision(False, MigrationReason.SLACK, why="the stream is catching up")
    ceiling = stream.tpot_target_s * settings.target_margin
    good: list[tuple[float, str]] = []
    for c in candidates:
        if not c.has_room or c.predicted_tpot_s > ceiling:
            continue
        # what the move saves over the rest of the stream must exceed the re-prefill it costs
        saved = stream.remaining_tokens * (stream.observed_tpot_s - c.predicted_tpot_s)
        if saved > c.resume_s:
            good.append((c.predicted_tpot_s + c.resume_s / stream.remaining_tokens, c.engine_id))
    if not good:
        return Decision(False, MigrationReason.SLACK, why="no engine with room would meet the TPOT target")
    good.sort()
    return Decision(
        True,
        MigrationReason.SLACK,
        targets=tuple(engine for _, engine in good),
        why=f"TPOT {stream.observed_tpot_s * 1e3:.1f} ms over its {stream.tpot_target_s * 1e3:.1f} ms target",
    )


__all__ = [
    "Candidate",
    "Decision",
    "MigrationReason",
    "MigrationSettings",
    "StreamView",
    "decide_on_failure",
    "decide_on_slack",
    "tpot_slack",
    "unsupported",
]
