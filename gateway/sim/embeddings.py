"""``POST /v1/embeddings`` of the simulated engine: inputs, vectors and the response body.

The engine side (each input is a prefill-only request in the batch, vLLM-pooling style) lives in
:mod:`gateway.sim.server`; this module is pure. A vector is a function of the input's token ids and
the engine's ``--seed`` only: a hash of them seeds a Gaussian draw of ``embedding_dim`` values, which
is normalised to unit length. Equal inputs therefore give equal vectors in every process and on
every engine with the same seed, different inputs give unrelated ones. ``dimensions`` keeps the
first ``d`` values and renormalises them (a matryoshka-style prefix of the full vector).
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.errors import described
from gateway.tokenizer import VOCAB_SIZE, encode

if TYPE_CHECKING:
    import numpy as np

ENCODINGS = ("float", "base64")
_MASK = (1 << 64) - 1


class EmbeddingInputError(ValueError):
    def __init__(self, message: str, param: str | None = "input") -> None:
        super().__init__(message)
        self.param = param


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(tokens: list[Any], where: str) -> list[int]:
    bad = next((t for t in tokens if not _is_token(t) or not 0 <= t < VOCAB_SIZE), None)
    if bad is not None:
        raise EmbeddingInputError(
            f"{where}: token id {described(bad)} is not in the vocabulary (0..{VOCAB_SIZE - 1})"
        )
    return tokens


def parse_input(value: Any) -> list[list[int]]:
    """Token ids of each input: a string, a list of strings, a list of token ids or a list of those."""
    if isinstance(value, str):
        prompts = [encode(value)]
    elif not isinstance(value, list) or not value:
        raise EmbeddingInputError(
            "input must be a string, a list of strings, a list of token ids or a list of token-id "
            f"lists, and not empty; got {described(value)}"
        )
    elif all(isinstance(v, str) for v in value):
        prompts = [encode(v) for v in value]
    elif all(_is_token(v) for v in value):
        prompts = [_token_ids(value, "input")]
    elif all(isinstance(v, list) for v in value):
        prompts = [_token_ids(v, f"input[{i}]") for i, v in enumerate(value)]
    else:
        raise EmbeddingInputError(
            "input must not mix types: give strings, token ids or token-id lists, one kind only"
        )
    for i, tokens in enumerate(prompts):
        if not tokens:
            raise EmbeddingInputError(f"input[{i}] is empty: a prompt needs at least one token")
    return prompts


def parse_options(body: dict[str, Any], full_dim: int) -> tuple[str, int | None]:
    """``encoding_format`` and ``dimensions`` (None: the full vector)."""
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise EmbeddingInputError(
            f"encoding_format must be one of {list(ENCODINGS)}, got {described(encoding)}", "encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_token(dimensions) or not 1 <= dimensions <= full_dim):
        raise EmbeddingInputError(
            f"dimensions must be an integer in [1, {full_dim}] (the model's embedding size), "
            f"got {described(dimensions)}",
            "dimensions",
        )
    return encoding, dimensions


def vector(tokens: Sequence[int], dim: int, seed: int, dimensions: int | None = None) -> np.ndarray:
    """The unit-length float32 embedding of ``tokens`` (first ``dimensions`` values, renormalised)."""
    import numpy as np  # (here: an engine that serves no embeddings starts without it, 80 ms sooner)

    digest = hashlib.blake2b(
        np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16, key=(seed & _MASK).to_bytes(8, "little")
    ).digest()
    values = np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(dim)
    if dimensions is not None:
        values = values[:dimensions]
    return (values / np.linalg.norm(values)).astype(np.float32)


def encoded(values: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        raw = values.astype("<f4", copy=False).tobytes()  # little-endian whatever the host, as OpenAI
        return base64.b64encode(raw).decode("ascii")
    # Python floats of the float32 values: a float and a base64 answer decode to the same numbers
    result: list[float] = values.tolist()
    return result


def response_body(
    request_id: str, model: str, vectors: Sequence[np.ndarray], encoding: str, prompt_tokens: int
) -> bytes:
    return orjson.dumps(
        {
            "id": f"embd-{request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [
                {"index": i, "object": "embedding", "embedding": encoded(v, encoding)}
                for i, v in enumerate(vectors)
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
    )
