"""A deterministic, reversible, dependency-free tokenizer shared by the simulated engine and the
gateway's prompt-token estimate.

Vocabulary: ids 0..255 are raw bytes; then every run of one to three lowercase ASCII letters, with
and without a leading space (" abc", "abc", ...); then a few ChatML special tokens. Encoding is one
regex pass (greedy: a space plus up to three letters is one token, anything else falls back to
UTF-8 bytes), so any text round-trips exactly and English-like text costs about one token per
three to four characters, close to real BPE tokenizers. Nothing is downloaded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from itertools import product
from typing import Any

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CHUNKS = [
    "".join(p) for n in (1, 2, 3) for p in product(_LETTERS, repeat=n)
]  # 26 + 676 + 17576 = 18278 letter chunks

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_BYTE_COUNT = 256
_CHUNK_BASE = _BYTE_COUNT
#: ids of space-led chunks are _CHUNK_BASE + 2*i, bare chunks _CHUNK_BASE + 2*i + 1
_SPECIAL_BASE = _CHUNK_BASE + 2 * len(_CHUNKS)
VOCAB_SIZE = _SPECIAL_BASE + len(SPECIAL_TOKENS)
EOS_ID = _SPECIAL_BASE  # <|endoftext|>
IM_START_ID = _SPECIAL_BASE + 1
IM_END_ID = _SPECIAL_BASE + 2
#: first and last id of the space-led three-letter chunks (what generated text is made of)
WORD_IDS = (_CHUNK_BASE + 2 * (26 + 676), _CHUNK_BASE + 2 * (len(_CHUNKS) - 1))

_TEXT: list[str] = [bytes([i]).decode("latin-1") for i in range(_BYTE_COUNT)]
for chunk in _CHUNKS:
    _TEXT.append(" " + chunk)
    _TEXT.append(chunk)
_TEXT.extend(SPECIAL_TOKENS)
_IDS: dict[str, int] = {text: i for i, text in enumerate(_TEXT) if i >= _BYTE_COUNT}

_PATTERN = re.compile(
    "|".join(re.escape(s) for s in SPECIAL_TOKENS) + r"| ?[a-z]{1,3}|[\x00-\x7f]|[^\x00-\x7f]+", re.DOTALL
)


def encode(text: str) -> list[int]:
    """Token ids of ``text``; ``decode(encode(text)) == text`` for every string."""
    ids: list[int] = []
    lookup = _IDS.get
    for piece in _PATTERN.findall(text):
        token = lookup(piece)
        if token is not None:
            ids.append(token)
        elif len(piece) == 1 and piece < "\x80":
            ids.append(ord(piece))
        else:
            ids.extend(piece.encode("utf-8"))
    return ids


def count_tokens(text: str) -> int:
    """``len(encode(text))``, exactly; for ASCII text (the common case) one regex pass that
    counts matches without building the id list. The gateway's prompt-token estimate calls it on
    the request path: about 0.3 ms for 4 KB of English text."""
    return len(_PATTERN.findall(text)) if text.isascii() else len(encode(text))


def token_text(token_id: int) -> str:
    """The text of one token; a lone byte token of a multi-byte character decodes as U+FFFD."""
    if token_id < _BYTE_COUNT:
        return bytes([token_id]).decode("utf-8", errors="replace")
    return _TEXT[token_id] if token_id < VOCAB_SIZE else "\ufffd"


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids``; byte tokens are joined before UTF-8 decoding so characters survive."""
    out: list[str] = []
    pending = bytearray()
    for token in ids:
        if token < _BYTE_COUNT:
            pending.append(token)
            continue
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
        out.append(_TEXT[token] if token < VOCAB_SIZE else "\ufffd")
    if pending:
        out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def apply_chat_template(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the assistant header."""
    parts = [
        f"<|im_start|>{m.get('role', 'user')}\n{_content_text(m.get('content'))}<|im_end|>\n"
        for m in messages
    ]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
