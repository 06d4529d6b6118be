"""Conditional disaggregation: does a request's prefill go to the prefill pool, or does one
decode-capable engine serve it whole?

What it decides: ``disaggregate`` (prefill on a prefill engine, then the decode stage) or not
(the request runs whole on a decode-capable engine, prefill included), with the reason.

From what: the request's prompt tokens, how many of its leading prompt tokens the best
decode-capable engine already caches (from the prefix index; ``None`` when unknown), and the
profile's setting: ``mode`` (``always`` | ``never`` | ``conditional``), ``min_prompt_tokens`` and
``max_cached_fraction``.

How: disaggregation pays a KV transfer and a second placement to keep prefills off the decode
engines; it is worth it when the prefill is long enough to disturb decoding (HyperFlexis §5.1's
separate P and D pools; DistServe's prefill/decode interference). ``conditional`` therefore skips
the prefill pool when the prompt is shorter than ``min_prompt_tokens`` or when more than
``max_cached_fraction`` of it is already cached on a decode-capable engine (little prefill is left
to do there). ``always`` disaggregates every request and never lets a prefill run on a decode
engine (the caller waits for, or fails over to, a prefill engine, but never prefills on a decode
one: llm-d#2427); ``never`` serves every request collocated.

Pure: no I/O, no clock, no imports from ``gateway``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DisaggregationMode(StrEnum):
    ALWAYS = "always"
    NEVER = "never"
    CONDITIONAL = "conditional"


@dataclass(frozen=True, slots=True)
class DisaggregationParams:
    mode: DisaggregationMode = DisaggregationMode.CONDITIONAL
    #: conditional: prompts shorter than this skip the prefill pool
    min_prompt_tokens: int = 256
    #: conditional: prompts cached on a decode-capable engine beyond this fraction skip it
    max_cached_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0:
            raise ValueError("min_prompt_tokens must be >= 0")
        if not 0.0 <= self.max_cached_fraction <= 1.0:
            raise ValueError("max_cached_fraction must be within 0..1")


@dataclass(frozen=True, slots=True)
class DisaggregationDecision:
    disaggregate: bool
    #: always | never | short_prompt | cached | long_prompt
    reason: str


def decide_disaggregation(
    prompt_tokens: int, cached_tokens: int | None, params: DisaggregationParams
) -> DisaggregationDecision:
    """Whether the request's prefill goes to the prefill pool (see the module docstring)."""
    if params.mode is DisaggregationMode.ALWAYS:
        return DisaggregationDecision(True, "always")
    if params.mode is DisaggregationMode.NEVER:
        return DisaggregationDecision(False, "never")
    if prompt_tokens < params.min_prompt_tokens:
        return DisaggregationDecision(False, "short_prompt")
    if cached_tokens is not None and prompt_tokens > 0:
        fraction = min(max(cached_tokens, 0), prompt_tokens) / prompt_tokens
        if fraction > params.max_cached_fraction:
            return DisaggregationDecision(False, "cached")
    return DisaggregationDecision(True, "long_prompt")
