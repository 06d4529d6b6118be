"""What the front door hands the router for a request: its prompt as the engine tokenizes it
(hashed into blocks by :class:`~gateway.fleet.block_hash.PromptBlocks`) and its session key.

The prompt is the whole prompt, every message, in the chat template's order: ChatML,
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message and the assistant's header, tokenized
with the gateway's tokenizer (``gateway/tokenizer.py``, the simulated engine's own). The same
token ids arrive in the engines' KV events, which the prefix index re-hashes with the same chain,
so the dispatch feed and the event feed key a block alike.

Cost, the issue's bound being <= 2 ms of gateway CPU for a 200 KB prompt:

- :func:`encode_array` is :func:`gateway.tokenizer.encode` vectorised with numpy (a handful of
  passes over the UTF-8 bytes, no Python step per token): ~1 ms for 200 KB of English against
  ~17 ms for the regex encoder, and the same ids (tests/gateway/test_prompt_key.py);
- every message's rendered tokens are cached (:class:`MessageTokens`, an LRU under a byte budget,
  keyed by role and content): a conversation's next turn repeats its history, which is then a
  dict hit per message, and only the new turn is encoded. A ChatML message starts and ends with
  a special token, which the encoder never merges with its neighbours, so the prompt's tokens are
  exactly the concatenation of its messages' tokens;
- the chain over the tokens is numpy too (~0.3 ms for 4,000 blocks).

Bodies parsed in the worker process (``gateway/api/parse_offload.py``) have their token ids
computed there (:func:`prompt_token_ids` runs in the worker, its cache lives there) and sent back
with the routing fields. A prompt longer than :data:`MAX_PROMPT_CHARS` characters is keyed by its
first :data:`MAX_PROMPT_CHARS` only: the index matches leading blocks, so the rest would only
matter to a second prompt sharing all of them.

Only chat and completions requests get blocks; the model, the body's ``cache_salt`` and no LoRA
root them (a LoRA adapter is served under its own model name, which is the model here).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gateway.fleet.block_hash import PromptBlocks, U64Array, root_key
from gateway.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, encode

#: characters of a prompt hashed at most (a 15 MB prompt is keyed by its first 4 MB)
MAX_PROMPT_CHARS = 4_000_000
#: bytes of token arrays the per-message cache keeps (8 bytes a token: 4M tokens)
MESSAGE_CACHE_BYTES = 32 << 20
#: messages shorter than this are encoded each time (a dict entry costs more than the encoding)
_CACHE_MIN_CHARS = 256

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_SPECIAL_ID = {s: VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, s in enumerate(SPECIAL_TOKENS)}
_IM_START = np.array([_SPECIAL_ID["<|im_start|>"]], dtype=np.uint64)
_IM_END_NL = np.array([_SPECIAL_ID["<|im_end|>"], ord("\n")], dtype=np.uint64)
_EMPTY = np.empty(0, dtype=np.uint64)
#: ids of letter chunks: 256 + 2 * index (space-led) or + 1 (bare); index of an n-letter chunk
#: is _CHUNK_OFFSET[n] + its letters read in base 26
_CHUNK_BASE = 256
_A = np.uint8(ord("a"))


#: bytes encoded in one numpy pass: its temporaries stay in the CPU's cache (whole 200 KB passes
#: were 3x slower, most of it first touches of fresh memory)
_PIECE = 16384
_SAFE = re.compile(rb"[^a-z ]")


def _encode_bytes(data: bytes) -> U64Array:
    """:func:`_encode_plain` in pieces of about :data:`_PIECE` bytes, each cut just after a byte
    that is neither a lowercase letter nor a space (no token spans such a cut, and letter runs
    restart after it)."""
    if len(data) <= 2 * _PIECE:
        return _encode_plain(data)
    parts: list[U64Array] = []
    start = 0
    while start < len(data):
        cut = start + _PIECE
        if cut >= len(data) - _PIECE // 2:
            cut = len(data)
        else:
            match = _SAFE.search(data, cut)
            cut = len(data) if match is None else match.end()
        parts.append(_encode_plain(data[start:cut]))
        start = cut
    return np.concatenate(parts)


def _encode_plain(data: bytes) -> U64Array:
    """:func:`encode` of a text without special tokens, from its UTF-8 bytes.

    Under the regex a token starts at every byte that is not a lowercase ASCII letter (ASCII one
    character a token, non-ASCII one byte a token), except a space with a letter after it, which
    opens the letter run's first chunk; and a run of letters is cut into chunks of three from its
    first letter. Elementwise passes and index gathers only (boolean-mask indexing is 5x slower).
    """
    n = len(data)
    if n == 0:
        return _EMPTY
    b = np.frombuffer(data, dtype=np.uint8)
    letter = (b - _A) < 26  # uint8 wraps: one compare for a <= byte <= z
    prev_letter = np.empty(n, dtype=bool)
    prev_letter[0] = False
    prev_letter[1:] = letter[:-1]
    run_start = letter & ~prev_letter
    # each letter's place in its run: its position less the latest run start's
    positions = np.arange(n, dtype=np.int32)
    latest = np.maximum.accumulate(np.where(run_start, positions, 0))
    place = positions - latest
    chunk = np.flatnonzero(letter & (place % 3 == 0))
    # letters after a chunk's first (a run is contiguous: a letter after one is the same run's)
    padded = np.zeros(n + 2, dtype=bool)
    padded[:n] = letter
    two = padded[chunk + 1]
    three = two & padded[chunk + 2]
    rest = np.zeros(n + 2, dtype=np.int64)
    rest[:n] = b
    rest -= ord("a")
    l0 = rest[chunk]
    l1 = rest[chunk + 1]
    l2 = rest[chunk + 2]
    index = np.where(three, 702 + 676 * l0 + 26 * l1 + l2, np.where(two, 26 + 26 * l0 + l1, l0))
    # a run's first chunk takes the space before it, and its token starts at that space
    first = place[chunk] == 0
    spaced = first & (chunk > 0)
    spaced &= b[np.maximum(chunk - 1, 0)] == 32
    at_chunk = chunk - spaced
    ids = b.astype(np.uint64)
    ids[at_chunk] = (_CHUNK_BASE + 1 + 2 * index - spaced).astype(np.uint64)
    starts = ~letter
    starts[at_chunk] = True
    out: U64Array = ids.take(np.flatnonzero(starts))
    return out


def encode_array(text: str) -> U64Array:
    """``encode(text)`` as a uint64 array, vectorised: the same ids, ~15x faster on long text.
    Raises UnicodeEncodeError on a lone surrogate (so does :func:`encode`)."""
    if "<|" not in text:
        return _encode_bytes(text.encode("utf-8"))
    parts: list[U64Array] = []
    for i, piece in enumerate(_SPECIAL_SPLIT.split(text)):
        if i % 2:
            parts.append(np.array([_SPECIAL_ID[piece]], dtype=np.uint64))
        elif piece:
            parts.append(_encode_bytes(piece.encode("utf-8")))
    return np.concatenate(parts) if parts else _EMPTY


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


class MessageTokens:
    """Rendered ChatML tokens per (role, content), least recently used first out, under a byte
    budget. One per process (the front door's, the parse worker's)."""

    def __init__(self, budget_bytes: int = MESSAGE_CACHE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, str], U64Array] = OrderedDict()

    def message(self, role: str, content: str) -> U64Array:
        """``<|im_start|>role\\ncontent<|im_end|>\\n`` as token ids."""
        if len(content) < _CACHE_MIN_CHARS:
            return self._render(role, content)
        key = (role, content)
        tokens = self._entries.get(key)
        if tokens is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return tokens
        self.misses += 1
        tokens = self._render(role, content)
        if tokens.nbytes <= self.budget_bytes // 4:
            self._entries[key] = tokens
            self.bytes += tokens.nbytes
            while self.bytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes
        return tokens

    @staticmethod
    def _render(role: str, content: str) -> U64Array:
        # the header "role\n" is plain text between two special tokens: no merge across them
        return np.concatenate((_IM_START, encode_array(f"{role}\n{content}"), _IM_END_NL))


_MESSAGES = MessageTokens()
_GENERATION_PROMPT = np.concatenate((_IM_START, encode_array("assistant\n")))


def chat_token_ids(messages: Sequence[Any], cache: MessageTokens | None = None) -> U64Array:
    """The chat's prompt as the engine tokenizes it (``encode(apply_chat_template(messages))``),
    capped at about :data:`MAX_PROMPT_CHARS` characters of content."""
    cache = _MESSAGES if cache is None else cache
    parts: list[U64Array] = []
    budget = MAX_PROMPT_CHARS
    for message in messages:
        if not isinstance(message, Mapping):
            return _EMPTY
        role = message.get("role", "user")
        content = _content_text(message.get("content"))
        if len(content) > budget:
            # keyed by its leading part only: no closing marker, so nothing after it matches
            parts.append(np.concatenate((_IM_START, encode_array(f"{role}\n{content[:budget]}"))))
            return np.concatenate(parts)
        budget -= len(content)
        parts.append(cache.message(str(role), content))
    parts.append(_GENERATION_PROMPT)
    return np.concatenate(parts)


def prompt_token_ids(kind: str, body: Mapping[str, Any]) -> U64Array | None:
    """Token ids of a chat or completions request's prompt (the first prompt of a batch of
    them); None for other requests or a prompt the gateway cannot tokenize."""
    try:
        if kind == "chat":
            messages = body.get("messages")
            if isinstance(messages, list) and messages:
                tokens = chat_token_ids(messages)
                return tokens if len(tokens) else None
            return None
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return encode_array(prompt[:MAX_PROMPT_CHARS]) if prompt else None
            if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt[:4]):
                return np.array(prompt, dtype=np.uint64)
    except (UnicodeEncodeError, ValueError, TypeError, OverflowError):
        return None
    return None


def prompt_blocks(model: str, tokens: U64Array | None, cache_salt: object = None) -> PromptBlocks | None:
    """The request's prompt keyed for the prefix index (None without tokens)."""
    if tokens is None or not len(tokens):
        return None
    salt = cache_salt if isinstance(cache_salt, str) else None
    return PromptBlocks(tokens, root_key(model, None, salt))


def reference_token_ids(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The slow, obviously right reading (for tests): the template rendered, then encoded."""
    from gateway.tokenizer import apply_chat_template

    return encode(apply_chat_template(messages))
