"""Synthetic prompt texts of a given length: the large bodies of ``slogate bench large-body`` and
the corpora the prompt-token estimate is tested on (tests/sim/test_tokenizer.py).

Each generator is deterministic for a seed and returns exactly ``n_chars`` characters.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# one string per list reads and edits better than 70 quoted words
_WORDS = (  # noqa: SIM905
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no will more "
    "about model engine request token latency prompt gateway stream queue batch routing schedule "
    "throughput memory cache answer question because however although between during without"
).split()
_PUNCTUATION = (",", ",", ".", ".", ";", ":", "?", "!")
_CYRILLIC = "Привет мир как дела сегодня хорошая погода модель запрос ответ очередь".split()  # noqa: SIM905
_CJK = "你好世界今天天气很好模型请求回答队列延迟吞吐量缓存调度"


def english_text(n_chars: int, seed: int = 0) -> str:
    """English-like prose: common words, capitalised sentences, punctuation, digits, newlines."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        words = rng.choices(_WORDS, k=rng.randint(6, 18))
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words) + rng.choice(_PUNCTUATION) + ("\n" if rng.random() < 0.1 else " ")
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_chars]


def non_ascii_text(n_chars: int, seed: int = 0) -> str:
    """Cyrillic and CJK with spaces and punctuation, and a few Latin words with accents."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        kind = rng.random()
        if kind < 0.5:
            piece = rng.choice(_CYRILLIC)
        elif kind < 0.85:
            piece = "".join(rng.choices(_CJK, k=rng.randint(2, 12)))
        else:
            piece = rng.choice(("café", "naïve", "Zürich", "señor", "—", "…", "déjà vu"))
        piece += rng.choice((" ", " ", " ", ", ", "。", ". "))
        parts.append(piece)
        size += len(piece)
    return "".join(parts)[:n_chars]


def random_bytes_text(n_chars: int, seed: int = 0) -> str:
    """Uniformly random byte values as Latin-1 characters: half of them non-ASCII, no words."""
    return random.Random(seed).randbytes(n_chars).decode("latin-1")


def mixed_text(n_chars: int, seed: int = 0) -> str:
    """Paragraphs alternating English and non-ASCII text (a translation or a multilingual RAG
    context): non-ASCII overall, with both token densities present in long runs."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        length = rng.randint(200, 2000)
        make = english_text if rng.random() < 0.6 else non_ascii_text
        parts.append(make(length, rng.randrange(1 << 30)) + "\n\n")
        size += length + 2
    return "".join(parts)[:n_chars]


def sectioned_text(n_chars: int, seed: int = 0) -> str:
    """Three long sections of different densities: English, then random bytes, then non-ASCII."""
    third = n_chars // 3
    return (
        english_text(third, seed)
        + random_bytes_text(third, seed + 1)
        + non_ascii_text(n_chars - 2 * third, seed + 2)
    )


GENERATORS: dict[str, Callable[[int, int], str]] = {
    "english": english_text,
    "non-ascii": non_ascii_text,
    "random-bytes": random_bytes_text,
    "mixed": mixed_text,
    "sectioned": sectioned_text,
}
