"""A deterministic, reversible, dependency-free tokenizer shared by the simulated engine and the
gateway's prompt-token estimate.

Vocabulary: ids 0..255 are raw bytes; then every run of one to three lowercase ASCII letters, with
and without a leading space (" abc", "abc", ...); then a few ChatML special tokens. Encoding is one
regex pass (greedy: a space plus up to three letters is one token, anything else falls back to
UTF-8 bytes), so any text round-trips exactly and English-like text costs about one token per
three to four characters, close to real BPE tokenizers. Nothing is downloaded.

Two counts: :func:`count_tokens` is exact (the simulated engine's accounting, and short prompts),
:func:`estimate_tokens` / :func:`estimate_total_tokens` are what the gateway routes by. Counting
costs ~30-60 ns per character, so an exact count of a 15 MB prompt would hold the gateway's
event loop for about a second; the estimate looks at ~2,000 positions whatever the prompt's size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from itertools import product
from math import isqrt
from typing import Any

import orjson

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
#: :data:`_PATTERN` with non-ASCII text matched one character at a time. A non-ASCII run encodes
#: to one byte token per UTF-8 byte, so a text's count is its matches here plus the bytes its
#: non-ASCII characters have beyond the first: exact, without building the id list.
_COUNT_PATTERN = re.compile(
    "|".join(re.escape(s) for s in SPECIAL_TOKENS) + r"| ?[a-z]{1,3}|[\x00-\x7f]|[^\x00-\x7f]", re.DOTALL
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
    """``len(encode(text))``, exactly, in one regex pass that counts matches without keeping them
    (``str.isascii`` is O(1): CPython records it when the string is built). About 30 ns per
    character of English, 60 ns of non-ASCII text: use :func:`estimate_tokens` on a request path."""
    matches = _COUNT_PATTERN.subn("", text)[1]
    if text.isascii():
        return matches
    # surrogatepass: a lone surrogate has no UTF-8 form; count the 3 bytes it would take rather
    # than raise (encode() raises on it; JSON parsers already reject it before the gateway).
    return matches + len(text.encode("utf-8", "surrogatepass")) - len(text)


#: below this many characters in all (every text of a request together) the estimate is exact:
#: counting 4 KB costs ~0.1-0.25 ms, and short prompts are where an error of a few tokens matters
EXACT_COUNT_CHARS = 4096
#: positions of a long prompt the estimate looks at, whatever its length (~0.1 ms)
_SITES = 2048
#: a text of a multi-text prompt longer than this is estimated on its own (its share of the sites,
#: at least _MIN_SITES); shorter ones are joined and estimated as one (a copy, ~0.2 ms per MB)
_SEPARATE_ABOVE = 65536
_MIN_SITES = 256
#: below this stride (texts under ~16K characters) every position is a site: nothing is sampled
_MIN_STRIDE = 16
#: two strides' estimates further apart than this (relative) mean one sees a repeating pattern in
#: one phase: ~1,000 sites each differ by ~5 % RMS on English (the noisiest), so 20 % is rare
_STRIDES_AGREE = 0.2
#: translate tables: 1 where a byte is a lowercase ASCII letter / a space / another ASCII character
_LOWER = bytes(97 <= b <= 122 for b in range(256))
_SPACE = bytes(b == 32 for b in range(256))
_OTHER = bytes(b < 128 and b != 32 and not 97 <= b <= 122 for b in range(256))


def estimate_tokens(text: str) -> int:
    """Prompt-token estimate for routing; exact up to :data:`EXACT_COUNT_CHARS` characters."""
    return estimate_total_tokens((text,))


def estimate_total_tokens(texts: Sequence[str]) -> int:
    """Estimated ``sum(count_tokens(t) for t in texts)``, at a cost that does not grow with them.

    Up to :data:`EXACT_COUNT_CHARS` characters in all the count is exact. Above, ~2,000 evenly
    spread positions are looked at and each is told whether a token starts there, by the rules of
    :data:`_PATTERN`, from the few characters around it (see :func:`_site_tokens`). Counting token
    starts where the text's own characters are, rather than applying one characters-per-token
    ratio, follows the text's mix wherever it changes: English (~0.3 tokens a character), digits
    and code (~1), non-ASCII (2-4, one per UTF-8 byte), in any proportion and at any scale.

    Error: sampling, above ~16K characters (below, every position is looked at), and unbiased:
    on English-like text (the fewest token starts per character, so the largest relative
    spread) ~3 % RMS and 7 % at worst over hundreds of texts from 5 KB to 15 MB; on non-ASCII,
    random-byte, paragraph-mixed, sectioned and prose-with-data-blocks texts, one text or many,
    within 4 %. tests/sim/test_tokenizer.py asserts 15 %. The rules themselves are exact but for
    letter runs over 8 letters (±1/3 token a run, zero on average) and special tokens written
    out in a prompt (counted character by character, ~7 tokens instead of one).
    Cost: ~0.1-0.2 ms for one text, whatever its length (measured up to 15 MB).
    """
    if len(texts) == 1:
        total = len(texts[0])
        if total <= EXACT_COUNT_CHARS:
            return count_tokens(texts[0])
        return max(1, round(_estimate(texts[0], _SITES)))
    lengths = list(map(len, texts))  # C loops from here on: a long chat has thousands of turns
    total = sum(lengths)
    if total <= EXACT_COUNT_CHARS:
        return sum(map(count_tokens, texts))
    tokens = 0.0
    small: Sequence[str] = texts
    if max(lengths) > _SEPARATE_ABOVE:
        small = []
        for text in texts:
            if len(text) > _SEPARATE_ABOVE:
                tokens += _estimate(text, max(_MIN_SITES, _SITES * len(text) // total))
            else:
                small.append(text)
    if small:
        # No token spans a newline, so count(a + "\n" + b) == count(a) + 1 + count(b) exactly:
        # the joined text's count less the newlines is the sum (a bare join would merge
        # "end " + "word" into " word" and lose ~5 % on chat turns).
        joined = "\n".join(small)
        if len(joined) <= EXACT_COUNT_CHARS:
            tokens += count_tokens(joined)
        else:
            tokens += _estimate(joined, max(_MIN_SITES, _SITES * len(joined) // total))
        tokens -= len(small) - 1
    return max(1, round(tokens))


def _estimate(text: str, sites: int) -> float:
    """Tokens of ``text`` from about ``sites`` positions (all of them in a short text).

    Two systematic samples with prime strides. Text repeating with a period T (a block pasted
    many times) puts every site of a stride in the same phase if T is a multiple of that stride;
    a period under the text's length can be a multiple of one such prime, not of two. So when the
    two disagree by more than sampling explains, a third stride is taken and the median of the
    three stands. The offsets derive from the length: a given prompt always gets one estimate.
    """
    size = len(text)
    step = size // max(1, sites // 2)
    if step < _MIN_STRIDE:
        return _site_tokens(text, 1, 0)
    seed = size * 2654435761
    first = _prime_at_least(step)
    second = _prime_at_least(first + 1)
    a = _stride_estimate(text, first, seed % first)
    b = _stride_estimate(text, second, (seed >> 16) % second)
    if abs(a - b) <= _STRIDES_AGREE * max(a, b):
        return (a + b) / 2
    third = _prime_at_least(second + 1)
    c = _stride_estimate(text, third, (seed >> 32) % third)
    return sorted((a, b, c))[1]


def _stride_estimate(text: str, stride: int, offset: int) -> float:
    """Tokens of ``text`` scaled from the sites ``offset + k * stride``."""
    positions = (len(text) - 1 - offset) // stride + 1
    return _site_tokens(text, stride, offset) * len(text) / positions


def _site_tokens(text: str, stride: int, offset: int) -> float:
    """Tokens starting at the positions ``offset + k * stride`` of ``text``.

    Under :data:`_PATTERN` a token starts at every ASCII character other than a lowercase letter
    or a space; at a space unless a lowercase letter follows (" abc" is one token); at the
    letters 0, 3, 6, ... of a run of lowercase letters (counted from its first letter); and a
    non-ASCII character is one token per UTF-8 byte. So each site needs only its neighbours: the
    character after it, and up to seven before it for its place in a letter run. Those come as
    strided slices shifted by -7..+1, turned into bit masks (one bit per site, via
    ``bytes.translate`` and ``int.from_bytes``) and combined with ``&`` and ``bit_count``: all of
    it C loops over ~1,000 sites, nothing per site in Python. Places 0, 3 and 6 of a run are
    exact; beyond, a letter counts 1/3 and a run ending there -1/3 (exact for runs of 8 letters
    or a multiple of 3 plus 2, within 1/3 of a token otherwise).
    """
    probe = text[offset::stride]
    sites = len(probe)
    here = probe.encode("latin-1", "replace")  # one byte per site; above U+00FF becomes "?"
    letters = [_mask(here, _LOWER)]
    for back in range(1, 8):
        letters.append(_mask(_shifted(text, offset - back, stride, sites), _LOWER))
    after = _mask(_shifted(text, offset + 1, stride, sites), _LOWER)

    beyond_latin1 = sites - len(probe.encode("latin-1", "ignore"))  # the "?" that were not
    tokens = float(_mask(here, _OTHER).bit_count() - beyond_latin1)
    space = _mask(here, _SPACE)
    tokens += (space ^ (space & after)).bit_count()  # a space not followed by a letter
    # run[k]: the site and the k letters before it are letters (place in the run >= k)
    run = [letters[0]]
    for k in range(1, 8):
        run.append(run[-1] & letters[k])
    tokens += (run[0] ^ run[1]).bit_count() + (run[3] ^ run[4]).bit_count() + (run[6] ^ run[7]).bit_count()
    longer = run[7]
    ends = longer ^ (longer & after)
    tokens += (longer.bit_count() - ends.bit_count()) / 3
    if not probe.isascii():
        ascii_len = len(probe.encode("ascii", "ignore"))
        tokens += len(probe.encode("utf-8", "surrogatepass")) - ascii_len
    return tokens


def _mask(data: bytes, table: bytes) -> int:
    """One bit per byte of ``data`` (bit 8*i for byte i) where ``table`` maps the byte to 1."""
    return int.from_bytes(data.translate(table), "little")


def _shifted(text: str, start: int, stride: int, sites: int) -> bytes:
    """The characters at ``start + k * stride`` for k < ``sites`` as one byte each (Latin-1,
    "?" above it); a newline, which is neither a letter nor a space, where that is outside."""
    pad = 0
    if start < 0:
        pad = (stride - 1 - start) // stride
        start += pad * stride
    probe = text[start::stride]
    if pad:
        probe = "\n" * pad + probe
    if len(probe) != sites:
        probe = probe[:sites] + "\n" * (sites - len(probe))
    return probe.encode("latin-1", "replace")


def _prime_at_least(n: int) -> int:
    """The smallest prime >= ``n`` (trial division: ~10 µs for the ~15,000 of a 15 MB text)."""
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, isqrt(n) + 1)):
        n += 1
    return n


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


def tools_content(tools: object) -> str:
    """What the template writes for a request's ``tools`` (as Qwen's and Hermes' ChatML
    templates do), as the content of a system turn ahead of the messages: each tool's JSON
    within ``<tools>``; "" for no tools. Raises ``ValueError`` for tools that cannot be written
    (nested too deep)."""
    if not isinstance(tools, list) or not tools:
        return ""
    return "<tools>\n" + "\n".join(map(_json, tools)) + "\n</tools>"


def tools_block(tools: object) -> str:
    """The system turn of :func:`tools_content` ("" for no tools)."""
    content = tools_content(tools)
    return f"<|im_start|>system\n{content}<|im_end|>\n" if content else ""


def message_text(message: Mapping[str, Any]) -> str:
    """A message's text as the template writes it: its content, then each call an assistant
    turn made (``tool_calls``) as a ``<tool_call>`` element. Raises ``ValueError`` as
    :func:`tools_block` does."""
    return _content_text(message.get("content")) + tool_calls_text(message.get("tool_calls"))


def tool_calls_text(calls: object) -> str:
    """What the template writes after an assistant turn's content for its ``tool_calls``."""
    if not isinstance(calls, list) or not calls:
        return ""
    return "".join(f"\n<tool_call>\n{_json(call)}\n</tool_call>" for call in calls)


def _json(value: object) -> str:
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ValueError(f"cannot be written into the prompt: {exc}") from None


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: object = None
) -> str:
    """ChatML: the tools' system turn (:func:`tools_block`), ``<|im_start|>role\\ntext<|im_end|>\\n``
    per message (:func:`message_text`), then the assistant header."""
    parts = [tools_block(tools)]
    parts += [f"<|im_start|>{m.get('role', 'user')}\n{message_text(m)}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
