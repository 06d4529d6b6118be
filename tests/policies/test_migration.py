"""The decode-migration trigger: which requests can be resumed, when a failure or a TPOT slack
deficit moves a stream, and to which engines."""

from __future__ import annotations

from typing import Any

import pytest

from policies.migration import (
    Candidate,
    MigrationReason,
    MigrationSettings,
    StreamView,
    decide_on_failure,
    decide_on_slack,
    tpot_slack,
    unsupported,
)

ON = MigrationSettings(limit=2, slack=True, slack_bound_s=1.0, min_remaining_tokens=16, target_margin=0.8)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({}, None),
        ({"n": 1, "temperature": 0}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, None),
        ({"tools": []}, None),
        # the engine parses a tool call out of the chat stream; a resumed stream is text only
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tool calls"),
        ({"tools": [{"type": "function"}]}, "tool calls"),
        ({"logprobs": False}, None),
        ({"stop": []}, None),
        ({"stop_token_ids": [7]}, None),
        ({"prompt": "one"}, None),
        ({"prompt": ["one"]}, None),
        ({"prompt": [11, 12, 13]}, None),  # one prompt, as token ids
        ({"prompt": [[11, 12]]}, None),
        ({"prompt": ["one", "two"]}, "a batch of 2 prompts"),
        ({"prompt": [[11, 12], [13]]}, "a batch of 2 prompts"),
        ({"n": 3}, "n = 3"),
        ({"n": 2.0}, "n = 2.0"),  # (an engine's JSON model takes 2.0 as 2)
        ({"n": 1.0}, None),
        ({"n": "2"}, "n = 2"),  # (an engine's pydantic model reads it as 2)
        ({"n": " 3 "}, "n = "),
        ({"n": "1"}, None),
        ({"n": "two"}, None),
        ({"best_of": 2.0}, "best_of"),
        ({"best_of": 2}, "best_of"),
        ({"use_beam_search": True}, "beam search"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format json_schema"),
        ({"response_format": {"type": "json_object"}}, "response_format json_object"),
        ({"guided_json": {}}, "guided_json"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"logprobs": True}, "log-probabilities"),
        ({"logprobs": 0}, "log-probabilities"),  # completions: the sampled token's log-probability
        ({"stop": ["\n"]}, "stop strings"),
        ({"stop": "END"}, "stop strings"),
        # they weigh the output so far, which a resumed stream sends as prompt
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -0.2}, "presence_penalty"),
        ({"frequency_penalty": 0, "presence_penalty": 0.0}, None),
        ({"repetition_penalty": 1.2}, None),  # (vLLM's weighs the prompt too: the same resumed)
    ],
)
def test_unsupported(body: dict[str, Any], why: str | None) -> None:
    got = unsupported(body)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_tpot_slack_is_kairos_eq2() -> None:
    # 10 tokens after the first at 50 ms target: 11 x 50 ms budget
    assert tpot_slack(0.05, 10, 0.5) == pytest.approx(0.05)
    assert tpot_slack(0.05, 10, 0.55) == pytest.approx(0.0)
    assert tpot_slack(0.05, 10, 0.7) == pytest.approx(-0.15)


@pytest.mark.parametrize(
    ("settings", "migrations", "blocked", "resumable", "migrate", "why"),
    [
        (ON, 0, None, True, True, "engine failure"),
        (ON, 1, None, True, True, "engine failure"),
        (ON, 2, None, True, False, "migration limit (2) reached"),
        (MigrationSettings(limit=0), 0, None, True, False, "off"),
        (ON, 0, "n = 2", True, False, "n = 2 cannot be resumed"),
        (ON, 0, None, False, False, "no token ids"),
    ],
)
def test_decide_on_failure(
    settings: MigrationSettings,
    migrations: int,
    blocked: str | None,
    resumable: bool,
    migrate: bool,
    why: str,
) -> None:
    stream = StreamView(migrations=migrations, remaining_tokens=100, tpot_target_s=0.05)
    decision = decide_on_failure(stream, settings, MigrationReason.FAILURE, blocked, resumable)
    assert decision.migrate is migrate
    assert why in decision.why
    assert decision.reason is MigrationReason.FAILURE


SLOW = StreamView(
    migrations=0, remaining_tokens=200, tpot_target_s=0.05, observed_tpot_s=0.15, negative_for_s=2.0
)
FAST = Candidate("fast", has_room=True, predicted_tpot_s=0.02, resume_s=0.1)


@pytest.mark.parametrize(
    ("stream", "candidates", "settings", "targets", "why"),
    [
        (SLOW, [FAST], ON, ("fast",), "TPOT 150.0 ms"),
        # best first: predicted pace plus the re-prefill spread over the remaining tokens
        (
            SLOW,
            [Candidate("b", True, 0.03, 0.0), FAST, Candidate("c", True, 0.02, 1.0)],
            ON,
            ("fast", "c", "b"),
            "",
        ),
        (SLOW, [FAST], MigrationSettings(limit=2, slack=False), (), "off"),
        (SLOW, [FAST], MigrationSettings(limit=0), (), "off"),
        (StreamView(2, 200, 0.05, 0.15, 2.0), [FAST], ON, (), "limit"),
        (StreamView(0, 200, 0.05, 0.15, 0.5), [FAST], ON, (), "not negative for long enough"),
        (StreamView(0, 10, 0.05, 0.15, 2.0), [FAST], ON, (), "too few tokens"),
        (StreamView(0, 200, 0.05, 0.04, 2.0), [FAST], ON, (), "keeps its TPOT pace"),
        # behind, but paying the deficit back (a transient stall): stays
        (StreamView(0, 200, 0.05, 0.15, 2.0, 0.03), [FAST], ON, (), "catching up"),
        # no token at all since the slack turned negative: moves
        (StreamView(0, 200, 0.05, 0.15, 2.0, float("inf")), [FAST], ON, ("fast",), ""),
        (SLOW, [Candidate("full", False, 0.02, 0.1)], ON, (), "no engine with room"),
        # 45 ms predicted > 0.8 x 50 ms: would not meet the target with margin
        (SLOW, [Candidate("meh", True, 0.045, 0.1)], ON, (), "no engine with room"),
        # the re-prefill costs more than the move saves over 20 tokens (20 x 0.13 s = 2.6 s)
        (StreamView(0, 20, 0.05, 0.15, 2.0), [Candidate("far", True, 0.02, 3.0)], ON, (), "no engine"),
        (SLOW, [], ON, (), "no engine with room"),
    ],
)
def test_decide_on_slack(
    stream: StreamView,
    candidates: list[Candidate],
    settings: MigrationSettings,
    targets: tuple[str, ...],
    why: str,
) -> None:
    decision = decide_on_slack(stream, candidates, settings)
    assert decision.migrate is bool(targets)
    assert decision.targets == targets
    assert why in decision.why
    assert decision.reason is MigrationReason.SLACK
