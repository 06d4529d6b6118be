"""Deterministic generation: the next token is a function of the whole sequence so far.

A 64-bit rolling hash runs over prompt and generated ids; each new token is derived from the
hash. Continuing a request elsewhere from ``prompt + first k outputs`` therefore yields exactly
the remaining outputs of the uninterrupted run, which is how decode migration is verified token
for token. Output is mostly space-led three-letter words with occasional punctuation, so decoded
text looks like text; EOS comes from the same hash (about one token in ``EOS_PERIOD``), so the
natural length is consistent under continuation too.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.tokenizer import EOS_ID, WORD_IDS

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3
_WORD_FIRST, _WORD_LAST = WORD_IDS
_WORDS = (_WORD_LAST - _WORD_FIRST) // 2 + 1
_PUNCTUATION = (ord(","), ord("."), ord("."), ord("?"))
EOS_PERIOD = 200  # mean natural output length in tokens when EOS is not ignored


def _mix(state: int, token: int) -> int:
    return ((state ^ (token + 0x9E3779B97F4A7C15)) * _PRIME) & _MASK


def _avalanche(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    return x ^ (x >> 33)


def sequence_state(tokens: Iterable[int], seed: int = 0) -> int:
    """Rolling state after ``tokens``; ``seed`` (the engine's ``--seed``) selects a different
    but equally deterministic "model", so continuation works only between same-seed engines."""
    state = 0xCBF29CE484222325 ^ _avalanche(seed & _MASK) if seed else 0xCBF29CE484222325
    for token in tokens:
        state = _mix(state, token)
    return state


def token_after(state: int, ignore_eos: bool) -> int:
    """The token that follows a sequence whose rolling state is ``state``."""
    x = _avalanche(state)
    if not ignore_eos and x % EOS_PERIOD == 0:
        return EOS_ID
    if (x >> 20) % 11 == 0:
        return _PUNCTUATION[(x >> 8) % len(_PUNCTUATION)]
    return _WORD_FIRST + 2 * ((x >> 24) % _WORDS)


def choice_state(prompt_state: int, choice: int) -> int:
    """The generator state of choice ``choice`` of an ``n > 1`` request whose prompt's rolling
    state is ``prompt_state``: choice 0 keeps the plain output (and continuation) of an ``n = 1``
    request; each other choice is moved to an unrelated state, so the n choices differ the way
    sampled ones would. Derived from the prompt's state, not by hashing the prompt again per
    choice (n choices of a long prompt held the engine's loop for n passes over it)."""
    if not choice:
        return prompt_state
    return _avalanche(prompt_state ^ ((choice * 0x9E3779B97F4A7C15) & _MASK)) | 1


class TokenStream:
    """Generator state of one request: O(prompt) to create, O(1) per token."""

    __slots__ = ("eos_id", "ignore_eos", "state")

    def __init__(
        self, prompt: Iterable[int], ignore_eos: bool, seed: int = 0, state: int | None = None
    ) -> None:
        """``state``: the rolling state the stream starts from, when known (``prompt`` is then
        not read)."""
        self.state = sequence_state(prompt, seed) if state is None else state
        self.ignore_eos = ignore_eos
        self.eos_id = EOS_ID

    def next_token(self) -> int:
        token = token_after(self.state, self.ignore_eos)
        self.state = _mix(self.state, token)
        return token
