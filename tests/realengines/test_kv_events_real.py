"""The precise prefix feed against a real vLLM (CPU build, prefix caching on, KV events over ZMQ).

vLLM tokenizes prompts with the model's own tokenizer; the gateway keys them for its prefix index
with the tokenizer ``engine_tokenizers`` names (here the tiny model's own directory), so the
blocks vLLM reports in its KV events and the blocks the front door keys are the same blocks.
Every check compares the gateway with what vLLM itself says: the prompt token ids it returns
(``return_token_ids``), the cached tokens it reports (``usage.prompt_tokens_details``), and its
``AllBlocksCleared`` after ``/reset_prefix_cache``. A second gateway subscribed to the same
events but keying with the gateway's own tokenizer (what every model got before
``engine_tokenizers``) sees the same blocks and matches none of its prompts: the control that
shows the keying is what this test checks.

The vLLM server (``vllm_kv``) is the session's FCFS one, which publishes KV events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.prompt_key import prompt_token_ids
from gateway.realengines.servers import RunningEngine
from gateway.realengines.tiny_models import ensure_hf_model
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.realengines.conftest import VLLM_KV_NAME

pytestmark = pytest.mark.real_engines

MODEL = VLLM_KV_NAME
ENGINE = "vllm-kv"
BLOCK = 128  # vLLM's block size on CPU

#: a system prompt of several 128-token blocks (the tiny tokenizer knows these words)
SYSTEM = " ".join(
    f"the {w} river runs under the old stone bridge, and the quiet {w} waits near the green garden."
    for w in (
        *("cat", "dog", "bird", "fish", "horse", "tree", "cloud", "rain", "sun", "moon", "star", "boat"),
        *("train", "book", "song", "light", "night", "day", "water", "fire", "wind", "snow", "city", "road"),
    )
)

CONFIG = """\
routing_profile: prefix-aware
monitor_interval_s: 0.25
# dispatch guesses expire at once: whatever the index matches, the engine's KV events put there
prefix_dispatch_ttl_s: 0.001
{tokenizers}engines:
  - {{name: {engine}, url: "{url}", kind: vllm, model: {model},
     kv_events_endpoint: "tcp://127.0.0.1:{port}", kv_events_topic: kv}}
"""


def _config(path: Path, engine: RunningEngine, port: int, tokenizer_dir: Path | None) -> Path:
    tokenizers = "" if tokenizer_dir is None else f'engine_tokenizers: {{{MODEL}: "{tokenizer_dir}"}}\n'
    path.write_text(
        CONFIG.format(tokenizers=tokenizers, engine=ENGINE, url=engine.url, model=MODEL, port=port)
    )
    return path


def _index(gw: RunningGateway) -> PrefixIndex:
    prefix = gw.gateway.prefix
    assert prefix is not None and prefix.index is not None
    return prefix.index


def _batches(gw: RunningGateway) -> int:
    feed = gw.gateway.kv_events
    assert feed is not None
    return feed.subscribers[ENGINE].stats.batches


def _blocks(tokens: list[int] | np.ndarray[Any, Any]) -> PromptBlocks:
    return PromptBlocks(np.asarray(tokens, dtype=np.uint64), root_key(MODEL))


def _chat(gw: RunningGateway, messages: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, str]]:
    """One chat through the gateway, with the routing decision and vLLM's prompt token ids."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"x-slogate-debug": "1"}, timeout=120)
    r.raise_for_status()
    decision = dict(part.split("=", 1) for part in r.headers["x-slogate-decision"].split("; "))
    data: dict[str, Any] = r.json()
    return data, decision


def _cached(decision: dict[str, str]) -> tuple[int, int]:
    cached, total = map(int, decision["cached_tokens"].split("/"))
    return cached, total


def test_kv_events_keep_the_index_in_step_with_vllm(
    vllm_kv: tuple[RunningEngine, int], tmp_path: Path
) -> None:
    engine, port = vllm_kv
    tokenizer_dir = ensure_hf_model()
    with (
        run_gateway(config_file=_config(tmp_path / "gw.yaml", engine, port, tokenizer_dir)) as gw,
        run_gateway(config_file=_config(tmp_path / "control.yaml", engine, port, None)) as control,
    ):
        index, control_index = _index(gw), _index(control)
        gateways = (gw, control)
        # the index learns vLLM's block size from its metrics; events of another size are skipped
        assert wait_until(
            lambda: all(_index(g).block_size(ENGINE) == BLOCK for g in gateways), timeout=30, interval=0.1
        ), [_index(g).block_size(ENGINE) for g in gateways]
        for g in gateways:
            feed = g.gateway.kv_events
            assert feed is not None
            assert wait_until(feed.subscribers[ENGINE].connected.is_set, timeout=10)
        # a warm-up prompt of its own (unrelated to what follows) until both subscriptions deliver
        # (ZMQ drops what a subscriber misses before its subscription reaches the publisher)
        for i in range(20):
            _chat(gw, [{"role": "user", "content": f"warm up {i}. {SYSTEM}"}])
            if wait_until(lambda: all(_batches(g) > 0 for g in gateways), timeout=2):
                break
        assert index.stats.stored > 0 and control_index.stats.stored > 0

        # 1. a long chat: the gateway keys it exactly as vLLM tokenizes it
        first = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "tell me about the cache."},
        ]
        data, decision = _chat(gw, first)
        assert decision["engine"] == ENGINE
        vllm_ids: list[int] = data["prompt_token_ids"]
        cached, total = _cached(decision)
        assert total == len(vllm_ids) == data["usage"]["prompt_tokens"], (total, len(vllm_ids))
        assert cached == 0
        n_blocks = len(vllm_ids) // BLOCK
        assert n_blocks >= 4, len(vllm_ids)
        # its blocks arrive as BlockStored events and hash to the keys of vLLM's own token ids
        blocks = _blocks(vllm_ids)
        assert wait_until(lambda: index.match_reported(blocks, [ENGINE])[ENGINE] == n_blocks, timeout=10), (
            index.match_reported(blocks, [ENGINE]),
            index.stats,
        )
        # the control saw the same events (its index holds vLLM's blocks) but keys the prompt with
        # the gateway's own tokenizer, whose blocks vLLM never reports: it matches nothing
        assert wait_until(
            lambda: control_index.match_reported(blocks, [ENGINE])[ENGINE] == n_blocks, timeout=10
        )
        own = prompt_token_ids("chat", {"messages": first})
        assert own is not None and len(own) >= BLOCK
        assert control_index.match_reported(_blocks(own), [ENGINE])[ENGINE] == 0

        # 2. the next turn shares the first prompt: the gateway expects exactly what vLLM reuses
        second = [
            *first,
            {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and the old stone bridge?"},
        ]
        data, decision = _chat(gw, second)
        cached, total = _cached(decision)
        assert total == data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])
        assert data["prompt_token_ids"][: len(vllm_ids)] == vllm_ids
        reported = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        # (whole blocks: the first prompt's, and one of its reply's when that filled a block)
        assert cached == reported >= n_blocks * BLOCK, (cached, reported, n_blocks)
        # the control gateway, asked the same, expects nothing: on its keys vLLM holds nothing
        _, control_decision = _chat(control, second)
        assert _cached(control_decision)[0] == 0

        # 3. a prefix-cache reset: vLLM's AllBlocksCleared empties the engine's part of the index.
        # vLLM publishes the events of a step after the step, so the reset goes out with the next
        # step of any request: a short one (no full block, no BlockStored of its own), sent to vLLM
        # directly so the gateway has written nothing for it
        cleared_before = index.stats.cleared
        r = httpx.post(engine.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text
        nudge = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "temperature": 0}
        httpx.post(engine.url + "/v1/completions", json=nudge, timeout=60).raise_for_status()
        assert wait_until(lambda: index.stats.cleared > cleared_before, timeout=10), index.stats
        assert index.entries(ENGINE) == 0
        assert index.match_reported(blocks, [ENGINE])[ENGINE] == 0
        # and the same chat again: neither the gateway nor vLLM finds anything cached
        data, decision = _chat(gw, second)
        assert _cached(decision)[0] == 0 == data["usage"]["prompt_tokens_details"]["cached_tokens"]
