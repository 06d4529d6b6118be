"""gateway/tokenizer.py: reversible, deterministic, fast."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from gateway import tokenizer as tok


@given(st.text())
def test_round_trip_any_text(text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.VOCAB_SIZE for i in ids)
    assert tok.count_tokens(text) == len(ids)


@given(st.lists(st.integers(256, tok.VOCAB_SIZE - 1), max_size=50))
def test_non_byte_ids_decode_to_their_texts(ids: list[int]) -> None:
    assert tok.decode(ids) == "".join(tok.token_text(i) for i in ids)


def test_words_are_chunks_and_specials_are_single_tokens() -> None:
    assert len(tok.encode(" the cat")) == 2
    assert tok.encode("<|im_start|>") == [tok.IM_START_ID]
    assert tok.token_text(tok.EOS_ID) == "<|endoftext|>"
    assert tok.encode("abcdef") == tok.encode("abc") + tok.encode("def")


def test_chat_template_accepts_string_and_parts() -> None:
    a = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    b = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    )
    assert a == b == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"


def test_count_tokens_is_fast() -> None:
    text = ("The quick brown fox jumps over the lazy dog; said Alice to Bob 42 times. " * 60)[:4096]
    tok.count_tokens(text)
    start = time.perf_counter()
    for _ in range(200):
        tok.count_tokens(text)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 1e-3, f"count_tokens took {per_call * 1e6:.0f} us on 4 KB"
