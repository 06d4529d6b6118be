"""What the front door hands the router for a request: its prompt as the engine tokenizes it
(hashed into blocks by :class:`~gateway.fleet.block_hash.PromptBlocks`) and its session key.

The prompt is the whole prompt, every message, in the chat template's order: ChatML,
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message and the assistant's header, tokenized
with the gateway's tokenizer (``gateway/tokenizer.py``, the simulated engine's own). The same
token ids arrive in the engines' KV events, which the prefix index re-hashes with the same chain,
so the dispatch feed and the event feed key a block alike.

Cost, the issue's bound being <= 2 ms of gateway CPU for a 200 KB prompt (``slogate bench
large-body --key-only`` measures it):

- :func:`encode_array` is :func:`gateway.tokenizer.encode` vectorised with numpy (boolean and
  uint16 passes over the UTF-8 bytes, in pieces of 128 KB, no Python step per token; see
  :func:`_encode_plain`): ~0.55 ms for 200 KB of English against ~17 ms for the regex encoder,
  ~1.5 ms for 200K characters of non-ASCII text (430 KB of UTF-8, whose ``str.encode`` alone
  takes 0.45 ms), and the same ids (tests/gateway/test_prompt_key.py);
- every message's rendered tokens are cached (:class:`MessageTokens`, an LRU under a byte budget,
  keyed by role and content, ids as uint16): a conversation's next turn repeats its history,
  which is then a dict hit per message, and only the new turn is encoded. A ChatML message starts
  and ends with a special token, which the encoder never merges with its neighbours, so the
  prompt's tokens are exactly the concatenation of its messages' tokens;
- the chain over the tokens is numpy too (~0.15 ms for the 4,800 blocks of 200 KB of English,
  ~0.7 ms for 26,000, half of that making the keys' Python ints).

Bodies parsed in the worker process (``gateway/api/parse_offload.py``) have their token ids
computed there (:func:`prompt_token_ids` runs in the worker, its cache lives there) and sent back
with the routing fields. A prompt longer than :data:`MAX_PROMPT_CHARS` characters, or
:data:`MAX_PROMPT_TOKENS` tokens, is keyed by its head only: the index matches leading blocks, so
the rest would only matter to a second prompt sharing all of them (a match is scored as a share of
the whole prompt's tokens all the same). A chat with a part that is not text (an image) is not
keyed: its tokens are unknown.

Only chat and completions requests get blocks; the model, the body's ``cache_salt`` and no LoRA
root them (a LoRA adapter is served under its own model name, which is the model here).
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.api.request_parse import truncation
from gateway.fleet.block_hash import PromptBlocks, U64Array, as_tokens, root_key
from gateway.responses_messages import conversation
from gateway.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, encode, tool_calls_text, tools_content

#: characters of a prompt hashed at most (a 15 MB prompt is keyed by its first 4 MB)
MAX_PROMPT_CHARS = 4_000_000
#: ...and tokens (16K blocks of 16): 4M characters of non-ASCII text are ~12M tokens here (one a
#: UTF-8 byte), whose 750K blocks took 0.3 s of the event loop to hash and record, and were more
#: than the index's whole budget, so recording them evicted everything the engine held
MAX_PROMPT_TOKENS = 1 << 18
#: bytes the per-message cache keeps: the token arrays (ids kept as uint16, 2 bytes a token) and
#: the message texts that key them (1 to 4 bytes a character, as CPython stores the string)
MESSAGE_CACHE_BYTES = 64 << 20
#: messages shorter than this are encoded each time (a dict entry costs more than the encoding)
_CACHE_MIN_CHARS = 256

_SPECIAL_SPLIT = re.compile(b"(" + b"|".join(re.escape(s.encode()) for s in SPECIAL_TOKENS) + b")")
_SPECIAL_ID = {s.encode(): VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, s in enumerate(SPECIAL_TOKENS)}

U16Array = npt.NDArray[np.uint16]
_BoolArray = npt.NDArray[np.bool_]
# every id fits 16 bits: the encoder works and the cache keeps ids as uint16, a quarter of uint64
assert VOCAB_SIZE <= 1 << 16
_IM_START_ID, _IM_END_ID, _NEWLINE = _SPECIAL_ID[b"<|im_start|>"], _SPECIAL_ID[b"<|im_end|>"], ord("\n")
_IM_START = np.array([_IM_START_ID], dtype=np.uint16)
_IM_END_NL = np.array([_IM_END_ID, _NEWLINE], dtype=np.uint16)
_EMPTY = np.empty(0, dtype=np.uint64)
_EMPTY16 = np.empty(0, dtype=np.uint16)


def _chunk_id_table() -> U16Array:
    """Id of the bare (no leading space) letter chunk whose letters have the digits d0, d1, d2
    (a..z as 1..26, 0 for no letter; with no second letter the third does not count), at
    ``d0 * 729 + d1 * 27 + d2``; a space-led chunk's id is one less. The tokenizer numbers chunks
    by length, then in base 26 (``gateway/tokenizer.py``): one letter 0..25, two 26..701, three
    702..18277; bare chunk i is ``256 + 2 * i + 1``."""
    key = np.arange(27**3)
    d0, d1, d2 = key // 729 - 1, key // 27 % 27 - 1, key % 27 - 1
    index = np.where(d1 < 0, d0, np.where(d2 < 0, 26 + 26 * d0 + d1, 702 + 676 * d0 + 26 * d1 + d2))
    table: U16Array = np.where(d0 >= 0, 257 + 2 * index, 0).astype(np.uint16)
    return table


_CHUNK_IDS = _chunk_id_table()
#: texts shorter than this are encoded by the regex tokenizer: the numpy encoder's fixed cost (~50
#: numpy calls, ~30 µs) is more than the regex's 0.05-0.15 µs a character below about this
_SMALL_CHARS = 256
#: bytes encoded as one piece (the last piece of a text, or one with no safe cut near, is longer).
#: Larger pieces mean fewer numpy calls; smaller, work arrays that stay in the CPU's cache
_PIECE = 131072
#: bytes the kept work arrays take a piece of (about 20 bytes of arrays a byte: ~4 MB a thread)
_WORK_BYTES = _PIECE + _PIECE // 2 + 1024
#: a piece whose chunk starts are fewer than this share of its bytes has their ids gathered one by
#: one (:func:`_chunk_ids_at`), otherwise computed at every byte (:func:`_chunk_ids_everywhere`)
_GATHER_BELOW = 0.125
#: a piece is cut just after a byte that is neither a lowercase letter nor a space
_SAFE = re.compile(rb"[^a-z ]")


class _Work:
    """The arrays a piece is encoded in, kept for the next piece and the next prompt.

    Arrays of this size are otherwise fresh pages from the kernel on every call, and faulting them
    in cost as much as the passes over them. The byte-wise arrays have one entry before the piece
    and two after (see :func:`_at`), so that "the byte before" and "the two after" are views.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        padded = size + 3
        self.raw = np.zeros(padded, dtype=np.uint8)
        self.digit = np.empty(padded, dtype=np.uint8)
        self.letter = np.empty(padded, dtype=bool)
        self.space = np.empty(padded, dtype=bool)
        self.chunk = np.empty(size, dtype=bool)
        self.window = np.empty(size, dtype=bool)
        self.spare = np.empty(size, dtype=bool)
        self.keep = np.empty(size, dtype=bool)
        self.ids = np.empty(size, dtype=np.uint16)
        # for :func:`_chunk_ids_everywhere`
        self.digit16 = np.empty(padded, dtype=np.uint16)
        self.base = np.empty(padded, dtype=np.uint16)
        self.cap = np.empty(padded, dtype=np.uint16)
        self.number = np.empty(size, dtype=np.uint16)
        self.term = np.empty(size, dtype=np.uint16)


_WORK = threading.local()  # one set per thread: the encoder writes into them


def _work(size: int) -> _Work:
    """Work arrays for a piece of ``size`` bytes: the thread's kept ones, or, for a piece longer
    than :data:`_WORK_BYTES` (a text with no safe cut for that long), arrays used once."""
    work: _Work | None = getattr(_WORK, "arrays", None)
    if work is not None and work.size >= size:
        return work
    if size > _WORK_BYTES:
        return _Work(size)
    work = _WORK.arrays = _Work(_WORK_BYTES)
    return work


def _at(padded: npt.NDArray[Any], n: int, k: int) -> npt.NDArray[Any]:
    """The view of a work array (``n`` bytes with one entry before, two after) whose entry p is
    byte ``p + k``'s, for k in -1..2."""
    return padded[1 + k : 1 + k + n]


def _chunk_starts(letter: _BoolArray, before: _BoolArray, work: _Work) -> _BoolArray:
    """The letters whose place in their run of letters is a multiple of three (where the
    tokenizer starts a chunk token), from ``letter`` and the same shifted by one.

    Place 0 is a letter after a non-letter. The rest by doubling: once every chunk start at a
    place below ``span`` (a multiple of three) is marked, a letter ``span`` after a marked one,
    with only letters between, starts a chunk at that place plus ``span``; one round marks all
    below ``2 * span``. ``window`` marks the letters ending ``span`` letters in a row, and
    doubles alike. Whole-array boolean passes, four per round: English words end the loop after
    two rounds, and a run of n letters takes log2(n / 3) (the obvious alternative, the latest run
    start by ``np.maximum.accumulate`` over positions, costs ~100 boolean passes' worth).
    """
    n = len(letter)
    chunk = work.chunk[:n]
    np.greater(letter, before, out=chunk)  # letter and not after one: a run's first letter
    if n <= 3:
        return chunk
    window, spare = work.window[:n], work.spare[:n]
    found = work.keep[:n]  # free until the caller marks the kept bytes
    window[:2] = False
    np.logical_and(letter[2:], letter[1:-1], out=window[2:])
    window[2:] &= letter[:-2]
    span = 3
    while span < n and window.any():
        found[:span] = False
        np.logical_and(chunk[:-span], window[span:], out=found[span:])
        chunk |= found
        spare[:span] = False
        np.logical_and(window[span:], window[:-span], out=spare[span:])
        window, spare = spare, window
        span *= 2
    return chunk


def _encode_plain(data: bytes) -> U16Array:
    """:func:`encode` of a text without special tokens, from its UTF-8 bytes, as uint16 ids.

    Under the regex a token starts at every byte that is not a lowercase ASCII letter (ASCII one
    character a token, non-ASCII one byte a token), except a space with a letter after it, which
    opens the letter run's first chunk; and a run of letters is cut into chunks of three from its
    first letter. So: elementwise passes over the bytes mark the chunk starts and the bytes that
    are tokens of their own; every byte's id is the byte, but a chunk start's is its chunk's; the
    marked ids are the tokens. A chunk's token sits at its first letter (the space that joins it
    is dropped), which keeps the order. No ``np.where`` or masked assignment: they branch on
    every element, and cost 5-10 passes' worth on text, where the masks alternate.
    """
    n = len(data)
    if n == 0:
        return _EMPTY16
    work = _work(n)
    padded = n + 3
    raw, digit = work.raw[:padded], work.digit[:padded]
    letter, space = work.letter[:padded], work.space[:padded]
    raw[1 : n + 1] = np.frombuffer(data, dtype=np.uint8)
    raw[n + 1 :] = 0  # raw[0] is never written: 0 too
    np.subtract(raw, np.uint8(97), out=digit)  # uint8 wraps: a..z are 0..25, nothing else is
    np.less(digit, np.uint8(26), out=letter)
    digit += np.uint8(1)
    digit *= letter  # a..z as 1..26, any other byte 0
    np.equal(raw, np.uint8(32), out=space)

    is_letter = _at(letter, n, 0)
    chunk = _chunk_starts(is_letter, _at(letter, n, -1), work)
    # a token of its own: neither a letter nor a space before one; or a chunk's first letter
    keep = work.keep[:n]
    np.logical_and(_at(space, n, 0), _at(letter, n, 1), out=keep)
    keep |= is_letter
    np.greater_equal(chunk, keep, out=keep)  # chunk or not (letter or space before one)

    ids = work.ids[:n]
    np.copyto(ids, _at(raw, n, 0))
    if np.count_nonzero(chunk) < _GATHER_BELOW * n:
        _chunk_ids_at(np.flatnonzero(chunk), work, n, ids)
    else:
        _chunk_ids_everywhere(work, n, ids)
    return _kept(ids, keep)


def _kept(ids: U16Array, keep: _BoolArray) -> U16Array:
    """``ids[keep]``, the cheaper way for the mask. Boolean indexing branches on every byte, and
    costs ~5x a gather where kept and dropped bytes alternate (English: every word drops
    letters), but half of one where few are dropped (non-ASCII text: only its few letters)."""
    if np.count_nonzero(keep) > len(keep) - (len(keep) >> 3):
        dense: U16Array = ids[keep]
        return dense
    out: U16Array = ids.take(np.flatnonzero(keep))
    return out


def _chunk_ids_at(starts: npt.NDArray[np.intp], work: _Work, n: int, ids: U16Array) -> None:
    """Write the id of the chunk starting at each of ``starts`` into ``ids``: its three digits
    gathered, looked up in :data:`_CHUNK_IDS`. About 4 ns a chunk (five gathers and a scatter):
    what a piece with few letters (non-ASCII text) needs."""
    digit, space = work.digit, work.space
    # (d0 * 27 + d1) * 27 + d2, in place in uint16 (an operation on a uint8 array and a scalar
    # stays uint8 under numpy 1.x's value-based casting, and would wrap)
    key = _at(digit, n, 0).take(starts).astype(np.uint16)
    for k in (1, 2):
        key *= np.uint16(27)
        key += _at(digit, n, k).take(starts)
    chunk_ids = _CHUNK_IDS.take(key)
    chunk_ids -= _at(space, n, -1).take(starts)  # led by a space: the id before
    ids[starts] = chunk_ids


def _chunk_ids_everywhere(work: _Work, n: int, ids: U16Array) -> None:
    """Write into ``ids``, at every letter, the id of the chunk that would start there (the
    letters that start none are not kept). Fifteen elementwise uint16 passes, ~1 ns a byte
    whatever the letters: what a piece of English needs (a third of its bytes start a chunk).

    The chunk's number in the tokenizer's order is its letters read in bijective base 26 (a..z
    are the digits 1..26) less one, so Horner's rule over the letter, the one after and the one
    after that; a byte that is not a letter of the chunk must count as neither a digit nor a
    shift: ``base`` is 26 after a letter and 1 after anything else, ``cap`` 26 and 0.
    """
    padded = n + 3
    letter = work.letter[:padded]
    digit, base, cap = work.digit16[:padded], work.base[:padded], work.cap[:padded]
    np.copyto(digit, work.digit[:padded])
    np.multiply(letter, np.uint16(26), out=cap)
    np.multiply(letter, np.uint16(25), out=base)
    base += np.uint16(1)
    number, term = work.number[:n], work.term[:n]
    np.multiply(_at(digit, n, 0), _at(base, n, 1), out=number)
    number += _at(digit, n, 1)
    # the third letter counts if the second does: base 26 only when both are letters
    np.minimum(_at(base, n, 1), _at(base, n, 2), out=term)
    number *= term
    np.minimum(_at(digit, n, 2), _at(cap, n, 1), out=term)
    number += term
    # the bare chunk's id, 256 + 2 * (number - 1) + 1, and one less led by a space
    number *= np.uint16(2)
    number += np.uint16(255)
    number -= _at(work.space, n, -1)
    number *= _at(letter, n, 0)
    np.maximum(ids, number, out=ids)  # a letter's id is above 255, any other byte's its own


def _encode_bytes(parts: list[U16Array], data: bytes) -> None:
    """Append the ids of ``data`` (UTF-8, no special tokens) to ``parts``: :func:`_encode_plain`
    in pieces of about :data:`_PIECE` bytes, each cut just after a byte that is neither a
    lowercase letter nor a space (no token spans such a cut, and letter runs restart after it)."""
    if len(data) <= _PIECE + _PIECE // 2:
        parts.append(_encode_plain(data))
        return
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


def _encode_text(parts: list[U16Array], text: str) -> None:
    """Append ``encode(text)`` to ``parts`` (raises UnicodeEncodeError on a lone surrogate, as
    :func:`encode` does)."""
    if len(text) < _SMALL_CHARS:
        if text:
            parts.append(np.array(encode(text), dtype=np.uint16))
        return
    data = text.encode("utf-8")
    # "<" and "|" are a memchr each (~3 us for 200 KB); the regex scans for "<|" at ~60 us, and
    # ``b"<|" in data`` at ~170 us
    if b"<" not in data or b"|" not in data or not _SPECIAL_SPLIT.search(data):
        _encode_bytes(parts, data)
        return
    # UTF-8 never has an ASCII byte inside a character, so the bytes split where the text would.
    # Special tokens and the short texts between them (a ChatML transcript pasted into a prompt)
    # are gathered into one list, and the regex tokenizer reads the short texts
    pending: list[int] = []
    for i, piece in enumerate(_SPECIAL_SPLIT.split(data)):
        if i % 2:
            pending.append(_SPECIAL_ID[piece])
        elif len(piece) < _SMALL_CHARS:
            pending += encode(piece.decode("utf-8"))
        else:
            if pending:
                parts.append(np.array(pending, dtype=np.uint16))
                pending = []
            _encode_bytes(parts, piece)
    if pending:
        parts.append(np.array(pending, dtype=np.uint16))


def _joined(parts: list[U16Array]) -> U64Array:
    """The parts as one uint64 array (what the chain hashes): one pass, however many parts."""
    if not parts:
        return _EMPTY
    out: U64Array = np.concatenate(parts, dtype=np.uint64)
    return out


def encode_array(text: str) -> U64Array:
    """``encode(text)`` as a uint64 array, vectorised: the same ids, ~40x faster on long text.
    Raises UnicodeEncodeError on a lone surrogate (so does :func:`encode`)."""
    parts: list[U16Array] = []
    _encode_text(parts, text)
    return _joined(parts)


#: content parts that are text (the Responses API's kinds too: vLLM parses them as text parts)
_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))


def _content_text(content: Any) -> tuple[str, bool]:
    """A message's text, and whether that is all of it (False at a part that is not text: an
    image, audio, whose tokens the gateway cannot know)."""
    if isinstance(content, str):
        return content, True
    if not isinstance(content, list):
        return "", True
    texts: list[str] = []
    for part in content:
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str) or part.get("type", "text") not in _TEXT_PARTS:
            return "".join(texts), False
        texts.append(text)
    return "".join(texts), True


class MessageTokens:
    """Rendered ChatML tokens per (role, content), least recently used first out, under a byte
    budget that counts each entry's token array and its key's text (the text is the larger: a
    budget of token bytes alone held 3 to 9 times as much). One per process (the front door's,
    the parse worker's). Ids are kept as uint16."""

    def __init__(self, budget_bytes: int = MESSAGE_CACHE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        #: (role, content) -> (token ids, the bytes the entry was counted at)
        self._entries: OrderedDict[tuple[str, str], tuple[U16Array, int]] = OrderedDict()

    def message(self, role: str, content: str) -> U16Array:
        """``<|im_start|>role\\ncontent<|im_end|>\\n`` as token ids."""
        if len(content) < _CACHE_MIN_CHARS:
            return self._render(role, content)
        key = (role, content)
        held = self._entries.get(key)
        if held is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return held[0]
        self.misses += 1
        tokens = self._render(role, content)
        # (counted now and taken back as counted: a string's size grows once something asks for
        # its UTF-8 form, as orjson does when the body is sent on)
        size = tokens.nbytes + sys.getsizeof(content)
        if size <= self.budget_bytes // 4:
            self._entries[key] = (tokens, size)
            self.bytes += size
            while self.bytes > self.budget_bytes:
                _, (_, old_size) = self._entries.popitem(last=False)
                self.bytes -= old_size
        return tokens

    @staticmethod
    def _render(role: str, content: str) -> U16Array:
        # the header "role\n" is plain text between two special tokens: no merge across them
        parts = [_IM_START]
        _encode_text(parts, f"{role}\n{content}")
        parts.append(_IM_END_NL)
        return np.concatenate(parts)


_MESSAGES = MessageTokens()
_GENERATION_PROMPT = np.concatenate((_IM_START, np.array(encode("assistant\n"), dtype=np.uint16)))


def chat_token_ids(
    messages: Sequence[Any], cache: MessageTokens | None = None, tools: object = None
) -> U64Array:
    """The chat's prompt as the engine tokenizes it
    (``encode(apply_chat_template(messages, tools=tools))``), capped at about
    :data:`MAX_PROMPT_CHARS` characters of content; empty for tools or tool calls the template
    cannot write."""
    cache = _MESSAGES if cache is None else cache
    parts: list[U16Array] = []
    try:
        listed = tools_content(tools)
    except ValueError:
        return _EMPTY
    if listed:
        # the template's system turn ahead of the messages, keyed, capped and cached as one (an
        # agent sends the same tools with every turn)
        messages = [{"role": "system", "content": listed}, *messages]
    # the ids of consecutive short messages (not cached), made one array: an agent's chat has
    # hundreds, and an array per message costs more than its regex encoding
    short: list[int] = []
    budget = MAX_PROMPT_CHARS
    for message in messages:
        if not isinstance(message, Mapping):
            return _EMPTY
        role = message.get("role", "user")
        content, whole = _content_text(message.get("content"))
        if whole and message.get("tool_calls"):
            try:
                content += tool_calls_text(message["tool_calls"])
            except ValueError:
                return _EMPTY
        if not whole:
            # a part the gateway cannot tokenize (an image): its tokens are unknown, and a key
            # of the text alone gave requests alike but for their images one key, and the
            # engine that took the first one full credit for every other (a key cut before it
            # would be scored as the whole prompt): not keyed, as the engine tokenizer leaves it
            return _EMPTY
        if len(content) > budget:
            # keyed by its leading part only: no closing marker, so nothing after it matches
            short.append(_IM_START_ID)
            parts.append(np.array(short, dtype=np.uint16))
            _encode_text(parts, f"{role}\n{content[:budget]}")
            return _joined(parts)
        budget -= len(content)
        if len(content) < _CACHE_MIN_CHARS:
            short += [_IM_START_ID, *encode(f"{role}\n{content}"), _IM_END_ID, _NEWLINE]
            continue
        if short:
            parts.append(np.array(short, dtype=np.uint16))
            short = []
        parts.append(cache.message(str(role), content))
    if short:
        parts.append(np.array(short, dtype=np.uint16))
    parts.append(_GENERATION_PROMPT)
    return _joined(parts)


def left_truncated(tokens: U64Array | None, body: Mapping[str, Any], capped: bool = False) -> U64Array | None:
    """``tokens`` as the engine keeps them under the body's ``truncate_prompt_tokens``: its
    cache then holds blocks of the last k tokens, not of the prompt's start. None when the
    prompt was ``capped`` (keyed by its first :data:`MAX_PROMPT_CHARS` characters only): the
    tokens the engine keeps are not among those."""
    k = truncation(body)
    if tokens is None or k is None:
        return tokens
    if capped:
        return None
    return tokens if len(tokens) <= k else tokens[len(tokens) - k :]


def _chat_capped(messages: Sequence[Any], body: Mapping[str, Any]) -> bool:
    """Whether the chat's text passes :data:`MAX_PROMPT_CHARS` (keyed by its start only); read
    only when the body asks for truncation."""
    if truncation(body) is None:
        return False
    try:
        total = len(tools_content(body.get("tools")))
    except ValueError:
        return False  # (not keyed at all)
    for message in messages:
        # (the text chat_token_ids keys, measured as it reads it: the repr of a content that is
        # not text was both wrong and, nested deep enough, a RecursionError)
        if not isinstance(message, Mapping):
            continue
        content, whole = _content_text(message.get("content"))
        total += len(content)
        if whole and message.get("tool_calls"):
            try:
                total += len(tool_calls_text(message["tool_calls"]))
            except ValueError:
                return False
    return total > MAX_PROMPT_CHARS


def responses_chat_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Responses API request as the chat request its engine renders the prompt of (its
    messages as vLLM builds them); None for one that continues another response (its prompt
    opens with a conversation only its engine has), has tools, or whose input makes no messages."""
    if body.get("previous_response_id") is not None or body.get("tools"):
        # (the engine writes a Responses request's tools, of another shape than chat's, after
        # converting them: not reproduced here)
        return None
    try:
        messages = conversation(body, None, None)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None
    return {"messages": messages} if messages else None


def prompt_token_ids(kind: str, body: Mapping[str, Any]) -> U64Array | None:
    """Token ids of a chat, completions or Responses API request's prompt (the first prompt of a
    batch of them), as the engine keeps them (:func:`left_truncated`); None for other requests or a
    prompt the gateway cannot tokenize."""
    if kind == "responses":
        chat = responses_chat_body(body)
        return None if chat is None else prompt_token_ids("chat", chat)
    try:
        if kind == "chat":
            messages = body.get("messages")
            if isinstance(messages, list) and messages:
                tokens = chat_token_ids(messages, tools=body.get("tools"))
                return left_truncated(tokens, body, _chat_capped(messages, body)) if len(tokens) else None
            return None
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                capped = len(prompt) > MAX_PROMPT_CHARS
                return (
                    left_truncated(encode_array(prompt[:MAX_PROMPT_CHARS]), body, capped) if prompt else None
                )
            if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt[:4]):
                # keyed by its leading part only, as a long text is: the whole array was built,
                # sent back from the parse worker and held for the request (64 MB for a 16 MB
                # body); as_tokens refuses what is not a token id (a float, a string past the
                # sample the body's check read), which np.array cast to one the engine never saw
                capped = len(prompt) > MAX_PROMPT_TOKENS
                return left_truncated(as_tokens(prompt[:MAX_PROMPT_TOKENS]), body, capped)
    except (UnicodeEncodeError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    return None


def prompt_blocks(
    model: str, tokens: U64Array | None, cache_salt: object = None, lora: str | None = None
) -> PromptBlocks | None:
    """The request's prompt keyed for the prefix index (None without tokens): rooted per model,
    LoRA adapter (``lora``: the adapter the request names; engines cache its blocks apart from
    the base model's) and ``cache_salt``."""
    if tokens is None or not len(tokens):
        return None
    salt = cache_salt if isinstance(cache_salt, str) else None
    return PromptBlocks(tokens[:MAX_PROMPT_TOKENS], root_key(model, lora, salt), len(tokens))


def reference_token_ids(messages: Sequence[Mapping[str, Any]], tools: object = None) -> list[int]:
    """The slow, obviously right reading (for tests): the template rendered, then encoded."""
    from gateway.tokenizer import apply_chat_template

    return encode(apply_chat_template(messages, tools=tools))
