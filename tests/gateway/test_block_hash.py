"""The gateway's block-hash chain: its definition, its roots, its cost, and vLLM's own hashing.

vLLM's hashes come from vLLM itself (``hash_block_tokens`` with ``sha256_cbor`` in the cached
vLLM CPU venv of the real-engine tier, run as a subprocess); those tests skip when the venv has
not been provisioned (``slogate engines prepare --vllm``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.block_hash import (
    _P,
    MASK64,
    PromptBlocks,
    as_tokens,
    block_digests,
    cbor_canonical,
    chain,
    external_hash,
    root_key,
    vllm_block_hashes,
)
from gateway.realengines._common import cache_dir
from gateway.realengines.vllm_env import is_vllm_env_ready, vllm_python, vllm_venv_dir
from gateway.tokenizer import encode


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 152_000) for _ in range(n)]


def test_chain_is_the_polynomial_recurrence_over_block_digests() -> None:
    tokens = _tokens(1, 16 * 40 + 7)
    root = root_key("m")
    keys = chain(tokens, 16, root)
    assert len(keys) == 40  # the 7 trailing tokens are no full block
    expected, h = [], root
    for digest in block_digests(as_tokens(tokens), 16).tolist():
        h = (h * _P + digest) & MASK64
        expected.append(h)
    assert keys == expected


def _digest(block: list[int]) -> int:
    """A block's digest by its definition, in Python integers: the multilinear sum with the
    SplitMix64 multipliers, then murmur3's finaliser (what ``block_digests`` vectorises)."""
    total = 0
    for k, token in enumerate(block):
        x = (0x5106A7E + k + 0x9E3779B97F4A7C15) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        total += token * ((x ^ (x >> 31)) | 1)
    x = total & MASK64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & MASK64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & MASK64
    return x ^ (x >> 33)


def _reference_chain(tokens: list[int], block_size: int, parent: int) -> list[int]:
    keys, h = [], parent & MASK64
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = (h * _P + _digest(tokens[start : start + block_size])) & MASK64
        keys.append(h)
    return keys


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 40_000), st.integers(0, MASK64)), max_size=300),
    st.integers(1, 40),
    st.integers(0, MASK64),
)
def test_chain_is_its_definition_in_python_integers(tokens: list[int], block_size: int, parent: int) -> None:
    expected = _reference_chain(tokens, block_size, parent)
    assert chain(tokens, block_size, parent) == expected
    assert chain(np.array(tokens, dtype=np.uint64), block_size, parent) == expected
    if all(t < 1 << 16 for t in tokens):  # the prompt encoder's narrow ids hash alike
        assert chain(np.array(tokens, dtype=np.uint16), block_size, parent) == expected


def test_chain_values_are_pinned() -> None:
    """The keys the prefix index and the KV-event feed share: a change here strands every key an
    index holds, so it must be deliberate (these values are from the chain as first shipped)."""
    tokens = encode("The quick brown fox jumps over the lazy dog. " * 8)
    keys = chain(tokens, 16, root_key("m"))
    assert [hex(k) for k in keys[:3]] + [hex(keys[-1])] == [
        "0x50182ce966fc733b",
        "0x4251b41efbf36604",
        "0xbae1bf741dfbd057",
        "0x11ddf69ea0a48023",
    ]
    big = [MASK64 - i * 7919 for i in range(48)]
    assert [hex(k) for k in chain(big, 16, 0)] == [
        "0xb6239d77563f32ff",
        "0xa80f86f4d66be11a",
        "0x8b7aed2a5ea769a7",
    ]
    assert [hex(k) for k in chain(list(range(10)), 4, 12345)] == ["0x96df3f70ea359c5c", "0x3ceb7b0feadf427d"]


def test_a_parent_key_continues_the_chain() -> None:
    """What the precise feed relies on: an event's blocks re-hash from the parent's key alone."""
    tokens = _tokens(2, 16 * 30)
    keys = chain(tokens, 16, root_key("m"))
    assert chain(tokens[16 * 12 :], 16, keys[11]) == keys[12:]


def test_keys_depend_on_everything_before_and_nothing_after() -> None:
    a = _tokens(3, 16 * 10)
    b = list(a)
    b[16 * 4 + 3] += 1  # one token of block 4 differs
    ka, kb = chain(a, 16, 7), chain(b, 16, 7)
    assert ka[:4] == kb[:4] and all(x != y for x, y in zip(ka[4:], kb[4:], strict=True))
    assert chain([*a, 1, 2, 3], 16, 7) == ka  # a partial block adds nothing


def test_roots_separate_model_lora_and_salt() -> None:
    roots = {
        root_key("m"),
        root_key("m2"),
        root_key("m", "adapter"),
        root_key("m", None, "salt"),
        root_key("m", "adapter", "salt"),
        root_key("m", ""),
        root_key("m", None, ""),
        root_key("ma", "dapter"),
    }
    assert len(roots) == 8
    tokens = _tokens(4, 64)
    assert chain(tokens, 16, root_key("m", None, "salt"))[0] != chain(tokens, 16, root_key("m"))[0]


def test_prompt_blocks_hash_once_per_block_size() -> None:
    tokens = np.arange(300, 300 + 16 * 8, dtype=np.uint64)
    blocks = PromptBlocks(tokens, root_key("m"))
    first = blocks.hashes(16)
    assert blocks.hashes(16) is first and len(blocks.hashes(32)) == 4
    assert first == chain(tokens.tolist(), 16, root_key("m"))


def test_bad_tokens_are_refused() -> None:
    with pytest.raises(ValueError):
        chain([1, -2, 3], 1, 0)
    with pytest.raises(ValueError):
        chain([1, 2], 0, 0)


def test_external_hashes() -> None:
    assert external_hash(5) == 5
    assert external_hash(-1) == MASK64  # a signed int64 and its unsigned twin are one hash
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest, "big") & MASK64
    with pytest.raises(ValueError):
        external_hash("ab")


def test_cbor_canonical_encodings() -> None:
    # RFC 8949 appendix A examples
    assert cbor_canonical(0) == bytes.fromhex("00")
    assert cbor_canonical(23) == bytes.fromhex("17")
    assert cbor_canonical(24) == bytes.fromhex("1818")
    assert cbor_canonical(1000) == bytes.fromhex("1903e8")
    assert cbor_canonical(1000000) == bytes.fromhex("1a000f4240")
    assert cbor_canonical(1000000000000) == bytes.fromhex("1b000000e8d4a51000")
    assert cbor_canonical(-1000) == bytes.fromhex("3903e7")
    assert cbor_canonical("IETF") == bytes.fromhex("6449455446")
    assert cbor_canonical(b"\x01\x02\x03\x04") == bytes.fromhex("4401020304")
    assert cbor_canonical((1, [2, 3], (4, 5))) == bytes.fromhex("8301820203820405")
    assert cbor_canonical(None) == b"\xf6"


# -- vLLM's own hashing ---------------------------------------------------------------------------

_VLLM_SCRIPT = """
import json, sys
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k

def tup(x):
    return tuple(tup(y) for y in x) if isinstance(x, list) else x

k.init_none_hash(sha256_cbor)
out = []
for case in json.load(sys.stdin):
    tokens, size, extras = case["tokens"], case["block_size"], case["extras"]
    parent, hashes = None, []
    for i in range(len(tokens) // size):
        extra = None if extras is None or extras[i] is None else tup(extras[i])
        parent = k.hash_block_tokens(sha256_cbor, parent, tokens[i * size:(i + 1) * size], extra)
        hashes.append(k.maybe_convert_block_hash(parent))
    out.append(hashes)
json.dump(out, sys.stdout)
"""

SEED = "1234"
BLOCK = 16
_SHARED = _tokens(10, BLOCK * 6)


def _cases() -> list[dict[str, Any]]:
    """Prompts that share prefixes of different lengths, some with a LoRA adapter or a salt,
    their extra keys built as vLLM 0.32 builds them (a tagged LoRA key on every block, a tagged
    salt on the first)."""
    cases: list[dict[str, Any]] = []
    plain = [
        _SHARED + _tokens(11, BLOCK * 3),
        _SHARED[: BLOCK * 4] + _tokens(12, BLOCK * 4),
        _SHARED + _tokens(11, BLOCK * 2 + 5),
        _tokens(13, BLOCK * 5),
    ]
    for tokens in plain:
        cases.append({"tokens": tokens, "block_size": BLOCK, "extras": None, "lora": None, "salt": None})
    for lora, salt in (("ad", None), (None, "s1"), (None, "s2"), ("ad", "s1")):
        tokens = _SHARED + _tokens(14, BLOCK)
        n = len(tokens) // BLOCK
        extras: list[list[Any] | None] = []
        for i in range(n):
            keys: list[Any] = []
            if lora is not None:
                keys.append(["lora", lora, f"/adapters/{lora}"])
            if salt is not None and i == 0:
                keys.append(["cache_salt", salt])
            extras.append(keys or None)
        cases.append({"tokens": tokens, "block_size": BLOCK, "extras": extras, "lora": lora, "salt": salt})
    return cases


@pytest.fixture(scope="module")
def vllm_hashes() -> Iterator[list[list[int]]]:
    if not is_vllm_env_ready():
        pytest.skip("the vLLM CPU venv is not provisioned (slogate engines prepare --vllm)")
    cases = json.dumps(_cases())
    # vLLM's answer depends only on its install, the script and the cases: kept beside the venv
    # (importing vLLM takes ~9 s of the suite), and asked again whenever any of them changes
    install = (vllm_venv_dir() / ".slogate-ok").read_text()
    key = hashlib.sha256("\0".join((install, _VLLM_SCRIPT, cases, SEED)).encode()).hexdigest()[:16]
    saved = cache_dir() / "reference" / f"vllm-block-hashes-{key}.json"
    with contextlib.suppress(OSError, ValueError):  # (missing or unreadable: ask vLLM again)
        yield json.loads(saved.read_text())
        return
    env = {**os.environ, "PYTHONHASHSEED": SEED, "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [str(vllm_python()), "-c", _VLLM_SCRIPT],
        input=cases,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    hashes = json.loads(done.stdout)
    saved.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=saved.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(json.dumps(hashes))
    Path(tmp.name).replace(saved)  # (whole or not at all, whoever writes it at the same time)
    yield hashes


def _tupled(extras: list[Any] | None) -> list[tuple[Any, ...] | None] | None:
    def tup(x: Any) -> Any:
        return tuple(tup(y) for y in x) if isinstance(x, list) else x

    return None if extras is None else [None if e is None else tup(e) for e in extras]


def test_vllm_sha256_cbor_chain_is_reproduced_exactly(vllm_hashes: list[list[int]]) -> None:
    """What an engine run with --prefix-caching-hash-algo sha256_cbor and PYTHONHASHSEED reports in
    its events, bit for bit, plain and with LoRA / salt extra keys."""
    for case, theirs in zip(_cases(), vllm_hashes, strict=True):
        ours = vllm_block_hashes(case["tokens"], case["block_size"], SEED, _tupled(case["extras"]))
        assert ours == theirs


def test_gateway_chain_matches_vllm_block_for_block(vllm_hashes: list[list[int]]) -> None:
    """The gateway's keys are other numbers, but two (prompt, block) pairs share a key exactly
    when vLLM gives them the same block hash: the same full blocks, the same chaining, LoRA and
    salt scoping the same, so a lookup counts the blocks vLLM would find cached."""
    ours_by_pair: dict[tuple[int, int], int] = {}
    theirs_by_pair: dict[tuple[int, int], int] = {}
    for c, (case, theirs) in enumerate(zip(_cases(), vllm_hashes, strict=True)):
        keys = chain(case["tokens"], BLOCK, root_key("m", case["lora"], case["salt"]))
        assert len(keys) == len(theirs)
        for b, (ours, their) in enumerate(zip(keys, theirs, strict=True)):
            ours_by_pair[(c, b)] = ours
            theirs_by_pair[(c, b)] = their
    pairs = list(ours_by_pair)
    shared = 0
    for i, p in enumerate(pairs):
        for q in pairs[i + 1 :]:
            same_ours = ours_by_pair[p] == ours_by_pair[q]
            assert same_ours == (theirs_by_pair[p] == theirs_by_pair[q]), (p, q)
            shared += same_ours
    # prompts 0 and 2 share 8 blocks, 1 shares 4 with each; LoRA and salt separate the rest
    assert shared == 16
