"""Conditional disaggregation: which requests skip the prefill pool."""

from __future__ import annotations

import pytest

from policies.disaggregation import (
    DisaggregationDecision,
    DisaggregationMode,
    DisaggregationParams,
    decide_disaggregation,
)

ALWAYS = DisaggregationParams(DisaggregationMode.ALWAYS)
NEVER = DisaggregationParams(DisaggregationMode.NEVER)
COND = DisaggregationParams(DisaggregationMode.CONDITIONAL, min_prompt_tokens=256, max_cached_fraction=0.5)


@pytest.mark.parametrize(
    ("prompt", "cached", "params", "expected"),
    [
        # always: every request goes to the prefill pool, short or cached (llm-d#2427)
        (10, None, ALWAYS, DisaggregationDecision(True, "always")),
        (4000, 4000, ALWAYS, DisaggregationDecision(True, "always")),
        (4000, None, NEVER, DisaggregationDecision(False, "never")),
        (255, None, COND, DisaggregationDecision(False, "short_prompt")),
        (256, None, COND, DisaggregationDecision(True, "long_prompt")),
        (1000, 500, COND, DisaggregationDecision(True, "long_prompt")),  # exactly the fraction
        (1000, 501, COND, DisaggregationDecision(False, "cached")),
        (1000, 5000, COND, DisaggregationDecision(False, "cached")),  # clamped to the prompt
        (1000, -3, COND, DisaggregationDecision(True, "long_prompt")),
        (1000, 0, COND, DisaggregationDecision(True, "long_prompt")),
        (0, None, DisaggregationParams(min_prompt_tokens=0), DisaggregationDecision(True, "long_prompt")),
    ],
)
def test_decide(
    prompt: int, cached: int | None, params: DisaggregationParams, expected: DisaggregationDecision
) -> None:
    assert decide_disaggregation(prompt, cached, params) == expected


@pytest.mark.parametrize("kwargs", [{"min_prompt_tokens": -1}, {"max_cached_fraction": 1.5}])
def test_bad_params(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DisaggregationParams(**kwargs)  # type: ignore[arg-type]


def test_mode_from_profile_text() -> None:
    assert DisaggregationMode("conditional") is DisaggregationMode.CONDITIONAL
