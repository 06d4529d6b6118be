"""Deterministic prompt token ids with real shared prefixes, for the simulator and live runs alike.

A request's prompt is the concatenation of its segments, each ``(seed, length)``: ``length``
tokens drawn from ``seed`` alone. Two requests listing the same leading segments therefore start
with the same token ids (a multi-turn session's later turns repeat the earlier turns' segments; a
task's shared system prompt is one segment every request of it begins with), and requests with no
segment in common share no prefix beyond chance.

Every token is a space-led three-letter word (ids :data:`gateway.tokenizer.WORD_IDS`), so
``encode(decode(ids)) == ids``: the text sent in a live run (:func:`spec_prompt_text`) is what the
simulated engine tokenizes back into exactly these ids, and what a simulator hashes into KV blocks
is what the live engines cache.
"""

from __future__ import annotations

import hashlib
import random
import sys
from array import array
from functools import lru_cache

from gateway.experiments.workload import RequestSpec
from gateway.tokenizer import WORD_IDS, decode

_FIRST_WORD = WORD_IDS[0]
_WORDS = (WORD_IDS[1] - WORD_IDS[0]) // 2 + 1  # space-led ids are every other id


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process (unlike ``hash()`` of a str)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@lru_cache(maxsize=8192)
def segment_tokens(seed: int, length: int) -> tuple[int, ...]:
    """``length`` word ids determined by ``seed`` alone.

    Cached because the segments that matter most are the repeated ones (a system prompt every
    session starts with, a conversation's history re-sent on every turn). 16 random bits per token
    in one ``getrandbits`` call keeps this a C loop; the modulo bias (65536 % 17576) is irrelevant
    to a cache.
    """
    if length <= 0:
        return ()
    raw = array("H", random.Random(seed).getrandbits(16 * length).to_bytes(2 * length, "little"))
    if sys.byteorder == "big":
        raw.byteswap()  # the same ids on every machine
    return tuple(_FIRST_WORD + 2 * (v % _WORDS) for v in raw)


def spec_segments(spec: RequestSpec) -> tuple[tuple[int, int], ...]:
    """The spec's segments; a spec built without any (older code) gets one segment seeded by its own
    fields, so it too has fixed ids, shared with no other request."""
    if spec.segments:
        return spec.segments
    seed = derive_seed("spec", spec.at, spec.task, spec.priority, spec.prompt_tokens, spec.output_tokens)
    return ((seed, spec.prompt_tokens),)


def prompt_token_ids(spec: RequestSpec) -> list[int]:
    """The prompt's token ids: its segments' tokens concatenated (``len == spec.prompt_tokens``)."""
    ids: list[int] = []
    for seed, length in spec_segments(spec):
        ids.extend(segment_tokens(seed, length))
    return ids


def spec_prompt_text(spec: RequestSpec) -> str:
    """The prompt as text (``" abc def ..."``), one gateway-tokenizer token per word."""
    return decode(prompt_token_ids(spec))
