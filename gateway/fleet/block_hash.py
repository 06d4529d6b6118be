"""Block hashes of a prompt: the gateway's own chain over full token blocks, and vLLM's for checks.

The prefix index asks one question: how many leading blocks of this prompt does an engine hold?
That needs a key per full block that depends on the block's tokens and on everything before it,
and on what the engine mixes in before the first token (model, LoRA adapter, ``cache_salt``). It
is the same partition and the same dependencies as vLLM's ``hash_block_tokens`` chain (only full
blocks; block *i* depends on blocks 0..i-1 through its parent; a LoRA name enters every block, a
``cache_salt`` only the first, so both reach every descendant), so two prompts share the key of
block *i* exactly when vLLM gives them the same block hash (barring collisions).

The values differ from vLLM's on purpose. vLLM's default (``sha256`` over a pickle, ``NONE_HASH``
from ``os.urandom`` unless ``PYTHONHASHSEED`` is set) cannot be reproduced outside the engine, and
its ``sha256_cbor`` costs a CBOR encoding and a SHA-256 per block: ~4,000 blocks for a 200 KB
prompt, several ms in Python. The gateway's chain is vectorised instead (numpy, no Python step per
block) and events from engines are re-hashed from their ``token_ids`` with it (see
``gateway/fleet/kv_events.py``), so one scheme serves every engine whatever it hashes with.

The chain: each block's tokens are reduced to a 64-bit digest ``c_i`` (a multilinear sum with odd
per-position multipliers, then a murmur3 finaliser), and the key is the polynomial chain
``h_i = P * h_(i-1) + c_i (mod 2^64)`` with ``h_(-1)`` the root. Unrolled,
``h_i = P^(i+1) * (root + sum_(j<=i) c_j * P^-(j+1))``: one cumulative sum, so the whole chain is
a handful of numpy passes. ``P`` is odd, hence invertible mod 2^64, and a parent's key is exactly
the state its children continue from, so an engine's event naming a known parent re-hashes
without the prompt before it.

This is not a cryptographic hash: someone who crafts prompts can make two prefixes collide. The
cost of a collision is one request routed to an engine that turns out not to hold its prefix
(the engine hashes for itself, so nothing is served wrong), and ``cache_salt`` still separates
tenants' roots.

:func:`vllm_block_hashes` computes vLLM's own ``sha256_cbor`` chain (what an engine started with
``--prefix-caching-hash-algo sha256_cbor`` and a fixed ``PYTHONHASHSEED`` reports in its events),
for tests and for checking an engine's events against the gateway's reading of the tokens.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

MASK64 = (1 << 64) - 1
#: the chain's multiplier (odd: invertible mod 2^64, so the chain unrolls into one cumulative sum)
_P = 0x9E3779B97F4A7C15
_P_INV = pow(_P, -1, 1 << 64)
_U64 = np.uint64
_FMIX1 = _U64(0xFF51AFD7ED558CCD)
_FMIX2 = _U64(0xC4CEB9FE1A85EC53)
_SHIFT33 = _U64(33)

U64Array = npt.NDArray[np.uint64]


def _splitmix64(x: int) -> int:
    """One step of SplitMix64: a fixed, platform-independent source for the block multipliers."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@lru_cache(maxsize=16)
def _multipliers(block_size: int) -> U64Array:
    """Odd per-position multipliers for a block of ``block_size`` tokens (odd: a token that
    differs alone always changes the sum, since token ids are far below 2^64)."""
    return np.array([_splitmix64(0x5106A7E + k) | 1 for k in range(block_size)], dtype=np.uint64)


class _Powers:
    """``P^1..P^n`` and ``P^-1..P^-n`` as uint64 arrays, grown (doubled) as longer prompts come."""

    def __init__(self) -> None:
        self.up: U64Array = np.empty(0, dtype=np.uint64)
        self.down: U64Array = np.empty(0, dtype=np.uint64)

    def ensure(self, n: int) -> None:
        if n <= len(self.up):
            return
        size = max(n, 2 * len(self.up), 1024)
        # uint64 array products wrap mod 2^64, which is the arithmetic the chain is defined in
        self.up = np.cumprod(np.full(size, _P, dtype=np.uint64), dtype=np.uint64)
        self.down = np.cumprod(np.full(size, _P_INV, dtype=np.uint64), dtype=np.uint64)


_POWERS = _Powers()


def _fmix(x: U64Array) -> U64Array:
    """murmur3's 64-bit finaliser, in place over an array: every input bit reaches every output
    bit, so the multilinear sum's weak low bits do not carry into the chain."""
    x ^= x >> _SHIFT33
    x *= _FMIX1
    x ^= x >> _SHIFT33
    x *= _FMIX2
    x ^= x >> _SHIFT33
    return x


def as_tokens(tokens: Sequence[int] | U64Array) -> U64Array:
    """Token ids as a uint64 array (a list goes through ``array.array``: ~3x faster than
    ``np.array`` on a Python list). Raises ValueError for a negative or oversized id."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.uint64:
            return tokens
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError("token ids must be >= 0")
        return tokens.astype(np.uint64)
    try:
        return np.frombuffer(array.array("Q", tokens), dtype=np.uint64)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2^64): {exc}") from None


def block_digests(tokens: U64Array, block_size: int) -> U64Array:
    """The 64-bit digest of every full block of ``tokens`` (independent of the chain)."""
    n = len(tokens) // block_size
    blocks = tokens[: n * block_size].reshape(n, block_size)
    # integer sums of products wrap mod 2^64 like the rest, without the n x block_size temporary;
    # einsum's loop is ~15% faster than matmul's for integers (neither uses BLAS)
    digests: U64Array = np.einsum("ij,j->i", blocks, _multipliers(block_size))
    return _fmix(digests)


def chain(tokens: Sequence[int] | U64Array, block_size: int, parent: int) -> list[int]:
    """Keys of every full block of ``tokens``, the first chained from ``parent`` (a root from
    :func:`root_key`, or the key of the block before ``tokens``). Linear in the prompt, no Python
    step per block: ~0.3 ms for the ~4,000 blocks of a 200 KB prompt."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    arr = as_tokens(tokens)
    n = len(arr) // block_size
    if n == 0:
        return []
    digests = block_digests(arr, block_size)
    _POWERS.ensure(n)
    digests *= _POWERS.down[:n]
    acc = np.cumsum(digests, dtype=np.uint64)
    acc += _U64(parent & MASK64)
    acc *= _POWERS.up[:n]
    keys: list[int] = acc.tolist()
    return keys


def root_key(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """The chain's starting point for one (model, LoRA adapter, ``cache_salt``).

    Each field is length-prefixed and ``None`` differs from ``""``, so no two triples share a
    root; BLAKE2b rather than ``hash()`` because ``str`` hashes change with PYTHONHASHSEED and
    the root must be the same in every gateway process.
    """
    h = hashlib.blake2b(digest_size=8, person=b"slogate-prefix")
    for part in (model, lora, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            data = part.encode("utf-8", "surrogatepass")
            h.update(b"\x01" + len(data).to_bytes(8, "big") + data)
    return int.from_bytes(h.digest(), "big")


class PromptBlocks:
    """One prompt's tokens under one root, hashed once per block size on first use.

    Engines of a model normally share a block size, so a request is hashed once however many
    engines it is matched against.
    """

    __slots__ = ("_by_size", "prompt_tokens", "root", "tokens")

    def __init__(self, tokens: Sequence[int] | U64Array, root: int, prompt_tokens: int | None = None) -> None:
        self.tokens = as_tokens(tokens)
        self.root = root
        #: the whole prompt's tokens, of which ``tokens`` may be the leading part only (what a
        #: match is a share of)
        self.prompt_tokens = (
            len(self.tokens) if prompt_tokens is None else max(prompt_tokens, len(self.tokens))
        )
        self._by_size: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def hashes(self, block_size: int) -> list[int]:
        keys = self._by_size.get(block_size)
        if keys is None:
            keys = self._by_size[block_size] = chain(self.tokens, block_size, self.root)
        return keys


# -- vLLM's own chain (sha256_cbor), for tests and cross-checks ----------------------------------


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head in its shortest form (RFC 8949 §4.2.1, what ``canonical=True`` emits)."""
    if value < 24:
        return bytes([major << 5 | value])
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | code]) + value.to_bytes(size, "big")
    raise ValueError(f"integer {value} does not fit CBOR's 64-bit head")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR of the values a vLLM block-hash input holds: ints, bytes, str, None, bool,
    tuples and lists (encoded as arrays, as cbor2 does). Anything else raises TypeError."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise TypeError(f"no canonical CBOR encoding here for {type(obj).__name__}")


def vllm_none_hash(seed: str) -> bytes:
    """vLLM's ``NONE_HASH`` under ``sha256_cbor``: the digest of the seed (``PYTHONHASHSEED``, or
    ``"vllm-none-hash"`` when unset in releases that default it; older ones drew it at random)."""
    return hashlib.sha256(cbor_canonical(seed)).digest()


def vllm_block_digests(
    tokens: Sequence[int],
    block_size: int,
    seed: str,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> list[bytes]:
    """vLLM's ``hash_block_tokens(sha256_cbor, parent, block, extra)`` chained over every full
    block: ``sha256(cbor((parent_digest, tuple(block), extra)))`` with ``NONE_HASH`` as the first
    parent. ``extra_keys[i]`` is block *i*'s extra-keys tuple as the engine builds it (its shape
    changed between vLLM releases, so the caller supplies it); ``None`` for plain text prompts."""
    parent = vllm_none_hash(seed)
    digests: list[bytes] = []
    for i, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        payload = (parent, tuple(tokens[start : start + block_size]), extra)
        parent = hashlib.sha256(cbor_canonical(payload)).digest()
        digests.append(parent)
    return digests


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: str,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> list[int]:
    """:func:`vllm_block_digests` as vLLM's KV events carry them: the digest's low 64 bits
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default)."""
    digests = vllm_block_digests(tokens, block_size, seed, extra_keys)
    return [int.from_bytes(d, "big") & MASK64 for d in digests]


def external_hash(value: object) -> int:
    """An engine's block hash from an event as an int: ints as they are (masked to 64 bits, so a
    signed int64 and its unsigned twin agree), bytes by their low 64 bits (vLLM with integer
    hashes turned off sends whole digests; llm-d takes the last 8 bytes the same way)."""
    if isinstance(value, bool):
        raise ValueError("a block hash is an int or bytes, not a bool")
    if isinstance(value, int):
        return value & MASK64
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[-8:], "big")
    raise ValueError(f"a block hash is an int or bytes, not {type(value).__name__}")
