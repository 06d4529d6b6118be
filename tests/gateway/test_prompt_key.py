"""The vectorised prompt encoder against the tokenizer it stands in for: property and fuzz tests.

``gateway.fleet.prompt_key`` keys prompts with a numpy reading of ``gateway.tokenizer.encode``;
the prefix index only matches blocks if the two agree on every id, for every text. The texts here
aim at the places a vectorised reading can go wrong: special-token fragments (``<|im_``), letter
runs of every length (chunks of three from the run's first letter, a space joining the first),
lone letters, spaces and non-ASCII bytes at the edges of the pieces the encoder works in, and
texts long enough to be cut into pieces at all.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.bench.texts import GENERATORS
from gateway.fleet import prompt_key
from gateway.fleet.prompt_key import (
    MessageTokens,
    chat_token_ids,
    encode_array,
    prompt_token_ids,
    reference_token_ids,
)
from gateway.tokenizer import SPECIAL_TOKENS, encode

#: pieces of text that tokenize differently next to each other: letters, spaces before letters,
#: special tokens whole and in fragments, ASCII that is not a letter, and 2/3/4-byte UTF-8
_FRAGMENTS = (
    *SPECIAL_TOKENS,
    "<|im_",
    "<|im_start",
    "<|",
    "|>",
    "<",
    "|",
    ">",
    "im_end|>",
    "<|endoftext",
    " ",
    "  ",
    "\n",
    "\t",
    "a",
    "z",
    "ab",
    "abc",
    "abcd",
    " a",
    " ab",
    " abc",
    " abcd",
    "A",
    "Z",
    "`",
    "{",
    "0",
    "9",
    ".",
    "\x00",
    "\x7f",
    "\x80",
    "é",
    "ü",
    "ÿ",
    "Ā",
    "中",
    "\u0800",
    "\uffff",
    "🙂",
    "\U0010ffff",
)
_texts = st.lists(
    st.one_of(
        st.sampled_from(_FRAGMENTS),
        st.text(alphabet="abcxyz ", max_size=40),
        st.integers(0, 40).map(lambda n: "q" * n),
        st.text(max_size=8),
    ),
    max_size=40,
).map("".join)


def _same(text: str) -> None:
    """``encode_array(text)`` is ``encode(text)``: as it stands, and with the numpy encoder forced
    on short texts (which it hands to the regex tokenizer) and forced to either way of finding
    chunk ids (gathered at the chunk starts, or computed at every byte)."""
    expected = encode(text)
    assert encode_array(text).tolist() == expected, repr(text)
    for gather_below in (0.0, 2.0):
        with (
            mock.patch.object(prompt_key, "_SMALL_CHARS", 0),
            mock.patch.object(prompt_key, "_GATHER_BELOW", gather_below),
        ):
            assert encode_array(text).tolist() == expected, (repr(text), gather_below)


@settings(max_examples=400, deadline=None)
@given(_texts)
@example("")
@example("a")
@example(" ")
@example(" a")
@example("<|im_start|>")
@example("<|im_<|im_end|>")
@example("é a")
def test_any_text_gets_the_tokenizer_s_ids(text: str) -> None:
    _same(text)


@settings(max_examples=300, deadline=None)
@given(_texts, st.integers(1, 48))
def test_the_ids_do_not_depend_on_where_pieces_are_cut(text: str, piece: int) -> None:
    """Pieces of a few bytes, so that every short text is cut, at every kind of boundary."""
    with mock.patch.object(prompt_key, "_PIECE", piece):
        _same(text)
        _same(text * 7)


def test_letter_runs_of_every_length_are_cut_in_threes_from_their_first_letter() -> None:
    """Runs around each power of two times three (where a doubling reading changes step),
    alone and after a space (which joins the first chunk), a capital, a digit, non-ASCII."""
    lengths = set(range(0, 40))
    for k in range(1, 14):
        lengths |= {3 * 2**k - 1, 3 * 2**k, 3 * 2**k + 1, 3 * 2**k + 2}
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in sorted(lengths):
        run = (letters * (n // 26 + 1))[:n]
        for before in ("", " ", "  ", "X", "7", "é", "\n "):
            for after in ("", " ", "Q", "é", " z"):
                _same(before + run + after)
        _same(" ".join([run] * 5))


def test_lone_letters_and_spaces_at_every_piece_boundary() -> None:
    rng = random.Random(11)
    alphabet = ["a", "b", " ", " ", "é", ".", "A", "中", "<|im_end|>"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(200)]
    for piece in range(1, 20):
        with mock.patch.object(prompt_key, "_PIECE", piece):
            for text in texts:
                _same(text)


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_long_texts_of_each_kind(kind: str) -> None:
    for seed, n in ((1, 1_000), (2, 70_000), (3, 300_000)):
        _same(GENERATORS[kind](n, seed))


def test_texts_without_a_safe_cut_and_longer_than_a_piece() -> None:
    for text in ("abcd" * 70_000, " abcd" * 50_000, "a" * 200_001, "é" * 100_000, " " * 150_000):
        _same(text)
        _same(text + "<|im_end|>" + text[:1000])


def test_sizes_up_and_down_reuse_no_stale_bytes() -> None:
    """One process encodes texts of every size in turn: a short text after a long one must not
    read what the long one left behind (the letters after its end, say)."""
    rng = random.Random(5)
    for _ in range(60):
        n = rng.choice((1, 2, 3, 4, 17, 300, 5_000, 90_000))
        text = GENERATORS[rng.choice(sorted(GENERATORS))](n, rng.randrange(1000))
        _same(text)
        _same(text[: rng.randint(0, 5)])


def test_a_pasted_transcript_of_special_tokens_and_texts_long_and_short() -> None:
    english, mixed = GENERATORS["english"], GENERATORS["mixed"]
    turns = [
        f"<|im_start|>user\n{english(n, n)}<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
        for n in (5, 255, 256, 257, 3_000, 1, 40)
    ]
    _same("".join(turns) * 3)
    _same("<|endoftext|>" + mixed(200_000, 1) + "<|im_end|>" * 50 + mixed(300, 2) + "<|im_start|>")


def test_a_lone_surrogate_is_refused_like_the_tokenizer_refuses_it() -> None:
    for text in ("abc\ud800", "\udfff", "x" * 70_000 + "\ud83d"):
        with pytest.raises(UnicodeEncodeError):
            encode(text)
        with pytest.raises(UnicodeEncodeError):
            encode_array(text)
    assert prompt_token_ids("completions", {"prompt": "abc\ud800"}) is None


_roles = st.sampled_from(["user", "system", "assistant", "tool", "", "<|im_end|>", "a b"])
_contents = st.one_of(_texts, st.integers(250, 600).map(lambda n: GENERATORS["mixed"](n, n)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.fixed_dictionaries({"role": _roles, "content": _contents}), min_size=1, max_size=6))
def test_a_chat_gets_the_ids_of_its_rendered_template(messages: list[dict[str, str]]) -> None:
    cache = MessageTokens()
    first = chat_token_ids(messages, cache)
    assert first.dtype.name == "uint64"
    assert first.tolist() == reference_token_ids(messages)
    assert chat_token_ids(messages, cache).tolist() == first.tolist()  # cached messages alike


def _capped_reference(messages: list[dict[str, str]], cap: int) -> list[int]:
    """The chat keyed up to ``cap`` characters of content: the template rendered, the message that
    crosses the cap cut there with no closing marker, nothing after it."""
    text, budget = "", cap
    for m in messages:
        role, content = m["role"], m["content"]
        if len(content) > budget:
            return encode(f"{text}<|im_start|>{role}\n{content[:budget]}")
        budget -= len(content)
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return encode(text + "<|im_start|>assistant\n")


_lengths = st.sampled_from([0, 1, 30, 255, 256, 257, 700])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_roles, _lengths), min_size=1, max_size=12), st.integers(0, 2_000))
def test_a_long_chat_is_keyed_up_to_the_cap_short_messages_and_long(
    shape: list[tuple[str, int]], cap: int
) -> None:
    messages = [{"role": role, "content": GENERATORS["mixed"](n, i)} for i, (role, n) in enumerate(shape)]
    with mock.patch.object(prompt_key, "MAX_PROMPT_CHARS", cap):
        assert chat_token_ids(messages, MessageTokens()).tolist() == _capped_reference(messages, cap)


def test_prompt_ids_are_uint64_for_every_kind() -> None:
    chat = prompt_token_ids("chat", {"messages": [{"role": "user", "content": "hi " * 300}]})
    text = prompt_token_ids("completions", {"prompt": "once upon a time " * 40})
    assert chat is not None and chat.dtype.name == "uint64"
    assert text is not None and text.dtype.name == "uint64"
    assert text.tolist() == encode("once upon a time " * 40)


def test_a_chat_with_an_image_is_not_keyed() -> None:
    """Parts that are not text were dropped: requests alike but for their images got one key,
    and the engine that took the first got full prefix credit for every other (their image
    tokens are not cached there)."""

    def chat(url: str) -> dict[str, object]:
        parts = [
            {"type": "text", "text": "what is in this picture? " * 20},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]}

    assert prompt_token_ids("chat", chat("https://example.com/a.png")) is None
    assert prompt_token_ids("chat", chat("https://example.com/b.png")) is None
    # text parts alone (with or without their type) are keyed as their text
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"text": "there"}]}]}
    keyed = prompt_token_ids("chat", text)
    plain = prompt_token_ids("chat", {"messages": [{"role": "user", "content": "hi there"}]})
    assert keyed is not None and plain is not None and keyed.tolist() == plain.tolist()


def test_a_truncated_prompt_is_keyed_by_the_tokens_the_engine_keeps() -> None:
    # vLLM's truncate_prompt_tokens keeps a prompt's last k tokens: the blocks it caches are of
    # those, and a key of the whole prompt would match none of them
    chat = {"messages": [{"role": "user", "content": "a long enough prompt " * 40}]}
    whole = prompt_token_ids("chat", chat)
    assert whole is not None and len(whole) > 20
    kept = prompt_token_ids("chat", {**chat, "truncate_prompt_tokens": 20})
    assert kept is not None and kept.tolist() == whole.tolist()[-20:]
    last = prompt_token_ids("completions", {"prompt": list(range(1, 50)), "truncate_prompt_tokens": 3})
    assert last is not None and last.tolist() == [47, 48, 49]
    text = {"prompt": "once upon a time " * 30, "truncate_prompt_tokens": 4}
    full = prompt_token_ids("completions", {"prompt": text["prompt"]})
    tail = prompt_token_ids("completions", text)
    assert full is not None and tail is not None and tail.tolist() == full.tolist()[-4:]
    # -1 (the model's own limit, unknown here), 0, a string, a bool, or more than the prompt: as is
    for value in (-1, 0, "20", True, 10_000):
        same = prompt_token_ids("chat", {**chat, "truncate_prompt_tokens": value})
        assert same is not None and same.tolist() == whole.tolist()
    # a whole float is a count, as the engine's JSON model reads it
    floated = prompt_token_ids("chat", {**chat, "truncate_prompt_tokens": 20.0})
    assert floated is not None and floated.tolist() == whole.tolist()[-20:]
    # a prompt keyed by its start only (past MAX_PROMPT_CHARS) is not keyed when truncated: the
    # engine keeps its end, which the key never read
    with mock.patch.object(prompt_key, "MAX_PROMPT_CHARS", 50):
        assert prompt_token_ids("chat", {**chat, "truncate_prompt_tokens": 20}) is None
        assert prompt_token_ids("completions", {"prompt": "x " * 60, "truncate_prompt_tokens": 5}) is None
        assert prompt_token_ids("completions", {"prompt": "x " * 60}) is not None


def test_a_prompt_of_token_ids_is_keyed_from_ids_alone_and_its_start_only() -> None:
    """np.array cast what is not a token id (a float, a string, past the few the check reads)
    to one the engine never saw, and built the whole array of a 16 MB body (64 MB sent back from
    the parse worker and held for the request) where only its first MAX_PROMPT_TOKENS are keyed."""
    assert prompt_token_ids("completions", {"prompt": [1, 2, 3, 4, 1.5, 6]}) is None
    assert prompt_token_ids("completions", {"prompt": [1, 2, 3, 4, "7"]}) is None
    with mock.patch.object(prompt_key, "MAX_PROMPT_TOKENS", 8):
        ids = prompt_token_ids("completions", {"prompt": list(range(1, 100))})
        assert ids is not None and ids.tolist() == list(range(1, 9))
        assert ids.nbytes == 8 * 8 and (
            ids.base is None or memoryview(ids.base).nbytes == 8 * 8
        )  # (no view of them all)
        # truncated, the engine keeps the end, which the key never read
        assert (
            prompt_token_ids("completions", {"prompt": list(range(1, 100)), "truncate_prompt_tokens": 4})
            is None
        )


def test_content_that_is_not_text_nested_deep_is_not_keyed_rather_than_a_500() -> None:
    """A truncated chat measured a content that is not text by its repr: wrong for a list of
    parts, and nested deep enough a RecursionError that reached the client as a 500."""
    deep: list[object] = []
    for _ in range(1200):
        deep = [deep]
    body = {"truncate_prompt_tokens": 5, "messages": [{"role": "user", "content": {"a": deep}}]}
    assert prompt_token_ids("chat", body) is not None  # (a message with nothing to say: its template)
    parts = [{"type": "text", "text": "a caption " * 10}]
    whole = prompt_token_ids("chat", {"messages": [{"role": "user", "content": parts}]})
    kept = prompt_token_ids(
        "chat", {"messages": [{"role": "user", "content": parts}], "truncate_prompt_tokens": 5}
    )
    assert whole is not None and kept is not None and kept.tolist() == whole.tolist()[-5:]


def test_a_responses_request_is_keyed_as_its_engine_renders_it() -> None:
    """A Responses request's prompt is the chat template over the messages vLLM makes of its
    instructions and input; one that continues another response, or has tools, is not keyed."""
    from gateway.responses_messages import conversation
    from gateway.tokenizer import apply_chat_template

    long_text = GENERATORS["mixed"](400, 3)
    bodies = [
        {"input": "hello there"},
        {"instructions": "be brief", "input": long_text},
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": long_text}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"role": "user", "content": "and then?"},
            ]
        },
    ]
    for body in bodies:
        keyed = prompt_token_ids("responses", body)
        assert keyed is not None, body
        assert keyed.tolist() == encode(apply_chat_template(conversation(body, None, None))), body
    as_chat = prompt_token_ids(
        "chat",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": long_text}]},
    )
    assert as_chat is not None and prompt_token_ids("responses", bodies[1]).tolist() == as_chat.tolist()  # type: ignore[union-attr]
    assert prompt_token_ids("responses", {"input": "hi", "previous_response_id": "resp_1"}) is None
    assert (
        prompt_token_ids("responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}]}) is None
    )
    assert (
        prompt_token_ids("responses", {"input": [{"type": "function_call"}]}) is None
    )  # (malformed: not keyed)


def test_keying_a_responses_request_leaves_its_body_as_it_came() -> None:
    """The conversion to chat messages fills the assistant turn a call follows: on a copy, never
    on the client's own item (which goes to the engine when the body is written again)."""
    import copy

    body = {
        "input": [
            {"role": "assistant", "content": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"role": "user", "content": "go on"},
        ]
    }
    before = copy.deepcopy(body)
    prompt_token_ids("responses", body)
    assert body == before
