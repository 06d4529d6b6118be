"""Tiny random models made locally (nothing may come from a model hub), cached on disk.

Two models, both random but with *readable* output:

* an HF-format ``LlamaForCausalLM`` (hidden 128, 2 layers, 2 heads, 1 KV head, head_dim 64, float32)
  with a byte-level BPE tokenizer trained here with ``tokenizers`` on a generated word corpus and a
  ChatML chat template, for vLLM;
* a llama GGUF written directly with ``gguf`` 0.19.0 (2 layers, n_embd 64, hand-made SentencePiece-style
  vocabulary: control tokens, 256 byte tokens, letters, word pieces and whole words), for llama.cpp.

Readable-output trick (both models): hidden channel 0 is a constant "bias channel". Every token
embedding has a large value there and the attention/MLP output projections never write to it, so after
the final RMSNorm channel 0 is a nearly constant positive number. The LM head then uses its column 0 as
a per-token bias: whole-word tokens and punctuation get ``+WORD_BIAS`` (plus random weights on the other
channels, so the choice among them depends on the context), every other token (bytes, word pieces,
control tokens) gets a large negative bias and no random part, and the end-of-turn token gets a tunable
``eos_weight``. At temperature 0 the output is deterministic: a stream of words and punctuation that stops
when EOS wins (or at ``max_tokens``).

Where the code runs: the HF model needs torch/transformers/tokenizers, so it is built by the vLLM
virtualenv's python (:mod:`gateway.realengines.vllm_env`); the GGUF only needs ``gguf`` + numpy, which a
small helper venv (``venv-tools``, a few seconds to create) provides. Both are run as
``python -m gateway.realengines.tiny_models build-hf|build-gguf OUT`` with the repo on ``PYTHONPATH``.

Layout under :func:`gateway.realengines._common.cache_dir`::

    models/tiny-llama-hf/          HF model + tokenizer (+ ``.slogate-ok``)
    models/tiny-llama.gguf         GGUF model (+ ``tiny-llama.gguf.ok``)
    venv-tools/                    helper venv with gguf==0.19.0
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gateway.realengines._common import (
    FileLock,
    cache_dir,
    logs_dir,
    run_logged,
    write_marker,
)
from gateway.realengines.progress import progress

MODEL_FORMAT_VERSION = 1  # bump to rebuild cached models after changing the recipe
GGUF_VERSION = "0.19.0"
DEFAULT_EOS_WEIGHT = 1.5  # > 1: a reply ends after its first sentence end; < 1: runs to max_tokens
EMBED_STD = 0.05
ALPHA = 1.0  # weight of "the successor of the current word"
BETA = 0.3  # weight of the prompt context (decides the first word of a reply)
BLOCKED_BIAS = -3.0

_WORD_TEXT = (
    "the a an and or but so then of to in on at by for with from over under near cat dog bird fish "
    "horse tree river stone cloud rain sun moon star road house garden city boat train book song "
    "light night day morning evening water fire wind snow red blue green small big old new quiet loud "
    "warm cold bright dark happy slow fast runs walks sings sleeps reads writes sees finds makes "
    "takes gives holds waits falls grows shines we you they it she he is are was were has have not "
    "very again here there today tomorrow always never hello yes no good model token cache server "
    "gateway request answer question test"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
PUNCTUATION: tuple[str, ...] = (".", ",", "!", "?")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------------------------
# Cache-level API (runs in any python; delegates the building to a venv that has the libraries)
# ---------------------------------------------------------------------------------------------------


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def hf_model_dir() -> Path:
    return models_dir() / "tiny-llama-hf"


def gguf_model_path() -> Path:
    return models_dir() / "tiny-llama.gguf"


def _hf_marker() -> Path:
    return hf_model_dir() / ".slogate-ok"


def _gguf_marker() -> Path:
    return gguf_model_path().with_suffix(".gguf.ok")


def _spec(eos_weight: float) -> dict[str, Any]:
    return {"format": MODEL_FORMAT_VERSION, "eos_weight": eos_weight}


def _marker_matches(marker: Path, spec: dict[str, Any]) -> bool:
    try:
        return bool(json.loads(marker.read_text()).get("spec") == spec)
    except (OSError, ValueError):
        return False


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _run_builder(python: Path, kind: str, out: Path, eos_weight: float, log: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")]))}
    run_logged(
        [python, "-m", "gateway.realengines.tiny_models", kind, out, "--eos-weight", str(eos_weight)],
        log,
        env=env,
        what=f"tiny model {kind}",
    )


def ensure_hf_model(
    *, eos_weight: float = DEFAULT_EOS_WEIGHT, force: bool = False, python: Path | None = None
) -> Path:
    """Return the directory of the tiny HF model, building it (once) with the vLLM venv's python."""
    spec = _spec(eos_weight)
    if not force and _marker_matches(_hf_marker(), spec):
        return hf_model_dir()
    if python is None:
        from gateway.realengines.vllm_env import ensure_vllm_env

        python = ensure_vllm_env()
    with FileLock("model-hf"):
        if force or not _marker_matches(_hf_marker(), spec):
            started = time.monotonic()
            progress(f"tiny HF model: training tokenizer and writing random weights to {hf_model_dir()}")
            tmp = hf_model_dir().with_name(hf_model_dir().name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _run_builder(python, "build-hf", tmp, eos_weight, logs_dir() / "models.log")
            shutil.rmtree(hf_model_dir(), ignore_errors=True)
            tmp.replace(hf_model_dir())
            write_marker(
                _hf_marker(), json.dumps({"spec": spec, "seconds": round(time.monotonic() - started, 1)})
            )
            progress(f"tiny HF model: ready ({time.monotonic() - started:.1f} s)")
    return hf_model_dir()


def tools_python() -> Path:
    """A small helper venv with ``gguf`` (and numpy) for writing the GGUF; created once."""
    venv = cache_dir() / "venv-tools"
    py = venv / "bin" / "python"
    marker = venv / ".slogate-ok"
    if marker.exists() and marker.read_text().strip() == GGUF_VERSION and py.exists():
        return py
    with FileLock("venv-tools"):
        if not (marker.exists() and marker.read_text().strip() == GGUF_VERSION):
            log = logs_dir() / "venv-tools.log"
            progress(f"helper venv: creating {venv} with gguf=={GGUF_VERSION}")
            shutil.rmtree(venv, ignore_errors=True)
            run_logged([sys.executable, "-m", "venv", venv], log, what="python -m venv")
            run_logged(
                [py, "-m", "pip", "install", "--progress-bar", "off", f"gguf=={GGUF_VERSION}", "numpy"],
                log,
                what="pip install gguf",
            )
            write_marker(marker, GGUF_VERSION + "\n")
    return py


def ensure_gguf_model(
    *, eos_weight: float = DEFAULT_EOS_WEIGHT, force: bool = False, python: Path | None = None
) -> Path:
    """Return the path of the tiny GGUF model, writing it (once) with the helper venv's python."""
    spec = _spec(eos_weight)
    if not force and _marker_matches(_gguf_marker(), spec):
        return gguf_model_path()
    if python is None:
        python = tools_python()
    with FileLock("model-gguf"):
        if force or not _marker_matches(_gguf_marker(), spec):
            started = time.monotonic()
            progress(f"tiny GGUF model: writing {gguf_model_path()}")
            tmp = gguf_model_path().with_suffix(".tmp.gguf")
            _run_builder(python, "build-gguf", tmp, eos_weight, logs_dir() / "models.log")
            tmp.replace(gguf_model_path())
            write_marker(
                _gguf_marker(), json.dumps({"spec": spec, "seconds": round(time.monotonic() - started, 1)})
            )
            progress(f"tiny GGUF model: ready ({time.monotonic() - started:.1f} s)")
    return gguf_model_path()


# ---------------------------------------------------------------------------------------------------
# Builders (run inside a venv that has the heavy libraries; imports are local on purpose)
# ---------------------------------------------------------------------------------------------------


def make_corpus(n_sentences: int = 4000, seed: int = 0) -> list[str]:
    """Random sentences over :data:`WORDS` with punctuation: the tokenizer's training text."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        if len(words) > 5 and rng.random() < 0.4:
            words[rng.randrange(2, len(words) - 1)] += ","
        lines.append(" ".join(words) + rng.choice(PUNCTUATION[:1] * 4 + PUNCTUATION[2:]))
    return lines


def readable_weights(
    np: Any,
    rng: Any,
    *,
    n_vocab: int,
    hidden: int,
    n_heads: int,
    head_dim: int,
    words: list[int],
    sentence_ends: list[int],
    eos_id: int,
    eos_weight: float,
) -> dict[str, Any]:
    """Hand-set weights for the readable-output trick, as numpy arrays in (out, in) layout.

    Hidden channels: ``0`` is the bias channel (1.0 in every embedding, never written by a layer),
    then three subspaces of ``k = (hidden - 1) // 3`` channels: ``W`` (word identity: random for word
    tokens, zero for every other token), ``T`` (random for every token) and ``C`` (context). Layer 0's
    attention has zero queries, so it averages the ``T`` parts of all tokens so far uniformly (a
    bag-of-words vector) and writes the average into ``C``; everything else is zero, so each layer is
    otherwise the identity. LM head rows:

    * word or punctuation ``w`` on a fixed random cycle: ``ALPHA * W[pred(w)] + BETA * random in C``.
      After a word its successor on the cycle wins; after any other token (the prompt's last one) the
      ``W`` term is exactly zero and the context decides, so the first word depends on the prompt;
    * EOS: ``eos_weight * ALPHA * (W['.'] + W['!'] + W['?'])``: with ``eos_weight > 1`` a reply stops
      right after its first sentence end, with ``eos_weight < 1`` it runs to ``max_tokens``;
    * every other token: a large negative bias (it never wins).
    """
    k = (hidden - 1) // 3
    sub_w = slice(1, 1 + k)
    sub_t = slice(1 + k, 1 + 2 * k)
    sub_c = slice(1 + 2 * k, 1 + 3 * k)
    embed = np.zeros((n_vocab, hidden), dtype=np.float32)
    embed[:, 0] = 1.0
    embed[words, sub_w] = rng.normal(0.0, EMBED_STD, (len(words), k))
    embed[:, sub_t] = rng.normal(0.0, EMBED_STD, (n_vocab, k))
    # RMSNorm scales a token by ~sqrt(hidden / |e|^2); v_proj scales it back to raw embedding size.
    scale = float(np.sqrt((1.0 + 2 * k * EMBED_STD**2) / hidden))
    v_proj = np.zeros((head_dim, hidden), dtype=np.float32)  # the single KV head
    v_proj[np.arange(k), np.arange(1 + k, 1 + 2 * k)] = scale
    o_proj = np.zeros((hidden, n_heads * head_dim), dtype=np.float32)
    rotation, _ = np.linalg.qr(rng.normal(0.0, 1.0, (k, k)))
    o_proj[sub_c, :k] = rotation  # head 0 only; head 1 sees the same values and is dropped
    head = np.zeros((n_vocab, hidden), dtype=np.float32)
    head[:, 0] = BLOCKED_BIAS
    w_unit = embed[:, sub_w] / (EMBED_STD**2 * k)  # w_unit[a] . embed[a, W] ~ 1
    for i, tok in enumerate(words):
        head[tok, 0] = 0.0
        head[tok, sub_w] = ALPHA * w_unit[words[i - 1]]
        head[tok, sub_c] = BETA * rng.normal(0.0, 1.0, k) / (EMBED_STD * k)
    head[eos_id, 0] = 0.0
    head[eos_id, sub_w] = eos_weight * ALPHA * w_unit[sentence_ends].sum(axis=0)
    return {
        "embed": embed,
        "v_proj": v_proj,
        "o_proj": o_proj,
        "lm_head": head.astype(np.float32),
    }


def word_cycle(rng: random.Random, word_ids: list[int], punct_ids: list[int]) -> list[int]:
    """Words in a random cycle order with the punctuation marks spread out evenly."""
    order = list(word_ids)
    rng.shuffle(order)
    step = max(1, len(order) // (len(punct_ids) + 1))
    for k, tok in enumerate(punct_ids):
        order.insert((k + 1) * step + k, tok)
    return order


def build_hf_model(out: Path, eos_weight: float = DEFAULT_EOS_WEIGHT, seed: int = 0) -> None:
    """Train the BPE tokenizer and write the random readable LlamaForCausalLM to ``out``."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)

    vocab = tok.get_vocab()
    n_vocab = len(vocab)
    word_ids = sorted(vocab["\u0120" + w] for w in WORDS if "\u0120" + w in vocab)
    punct_ids = [vocab[p] for p in PUNCTUATION if p in vocab]
    eos_id = vocab["<|im_end|>"]

    hidden, layers, heads, kv_heads, head_dim = 128, 2, 2, 1, 64
    config = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=eos_id,
        pad_token_id=vocab["<|endoftext|>"],
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    rng = np.random.default_rng(seed)
    cycle = word_cycle(random.Random(seed), word_ids, punct_ids)
    w = readable_weights(
        np,
        rng,
        n_vocab=n_vocab,
        hidden=hidden,
        n_heads=heads,
        head_dim=head_dim,
        words=cycle,
        sentence_ends=[vocab[p] for p in ".!?"],
        eos_id=eos_id,
        eos_weight=eos_weight,
    )
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for norm in [model.model.norm] + [
            m for lyr in model.model.layers for m in (lyr.input_layernorm, lyr.post_attention_layernorm)
        ]:
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.from_numpy(w["embed"]))
        model.model.layers[0].self_attn.v_proj.weight.copy_(torch.from_numpy(w["v_proj"]))
        model.model.layers[0].self_attn.o_proj.weight.copy_(torch.from_numpy(w["o_proj"]))
        model.lm_head.weight.copy_(torch.from_numpy(w["lm_head"]))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    (out / "slogate-model.json").write_text(
        json.dumps({"cycle": len(cycle), "vocab": n_vocab, "eos_weight": eos_weight}, indent=1)
    )


def gguf_vocab() -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """Hand-made SentencePiece-style vocabulary: (tokens, scores, token types, named ids).

    llama.cpp's SPM tokenizer merges adjacent pieces only when the merged piece is in the vocabulary,
    so every prefix of every ``▁word`` is included (scored by length so longer pieces win); anything
    else falls back to the byte tokens.
    """
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []

    def add(piece: str, score: float, kind: int) -> None:
        tokens.append(piece)
        scores.append(score)
        types.append(kind)

    add("<unk>", 0.0, unknown)
    add("<s>", 0.0, control)
    add("</s>", 0.0, control)
    add("<|im_start|>", 0.0, control)
    add("<|im_end|>", 0.0, control)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, byte)
    pieces: set[str] = set()
    for ch in "\u2581abcdefghijklmnopqrstuvwxyz" + "".join(PUNCTUATION):
        pieces.add(ch)
    for word in WORDS:
        full = "\u2581" + word
        for end in range(2, len(full) + 1):
            pieces.add(full[:end])
    for piece in sorted(pieces, key=lambda p: (len(p), p)):
        add(piece, float(len(piece)), normal)
    named = {"unk": 0, "bos": 1, "eos": 2, "im_start": 3, "im_end": 4}
    return tokens, scores, types, named


def build_gguf_model(out: Path, eos_weight: float = DEFAULT_EOS_WEIGHT, seed: int = 0) -> None:
    """Write the tiny random readable llama GGUF to ``out`` with the ``gguf`` package."""
    import gguf
    import numpy as np

    n_embd, n_layer, n_head, n_head_kv, n_ff = 64, 2, 2, 1, 128
    head_dim = n_embd // n_head
    tokens, scores, types, named = gguf_vocab()
    n_vocab = len(tokens)
    index = {t: i for i, t in enumerate(tokens)}
    word_ids = [index["\u2581" + w] for w in WORDS]
    punct_ids = [index[p] for p in PUNCTUATION]
    cycle = word_cycle(random.Random(seed), word_ids, punct_ids)
    rng = np.random.default_rng(seed)
    w = readable_weights(
        np,
        rng,
        n_vocab=n_vocab,
        hidden=n_embd,
        n_heads=n_head,
        head_dim=head_dim,
        words=cycle,
        sentence_ends=[index[p] for p in ".!?"],
        eos_id=named["im_end"],
        eos_weight=eos_weight,
    )

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("slogate-tiny-llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(named["bos"])
    writer.add_eos_token_id(named["im_end"])
    writer.add_eot_token_id(named["im_end"])
    writer.add_unk_token_id(named["unk"])
    writer.add_pad_token_id(named["eos"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def zeros(*shape: int) -> Any:
        return np.zeros(shape, dtype=np.float32)

    # numpy shapes are (rows, cols) = (out_features, in_features); gguf stores them as ggml ne reversed.
    writer.add_tensor("token_embd.weight", w["embed"])
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", zeros(n_head * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", zeros(n_head_kv * head_dim, n_embd))
        writer.add_tensor(
            f"blk.{i}.attn_v.weight", w["v_proj"] if i == 0 else zeros(n_head_kv * head_dim, n_embd)
        )
        writer.add_tensor(
            f"blk.{i}.attn_output.weight", w["o_proj"] if i == 0 else zeros(n_embd, n_head * head_dim)
        )
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", zeros(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", zeros(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", zeros(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", w["lm_head"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gateway.realengines.tiny_models")
    parser.add_argument("kind", choices=["build-hf", "build-gguf"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--eos-weight", type=float, default=DEFAULT_EOS_WEIGHT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "build-hf":
        build_hf_model(args.out, eos_weight=args.eos_weight, seed=args.seed)
    else:
        build_gguf_model(args.out, eos_weight=args.eos_weight, seed=args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
