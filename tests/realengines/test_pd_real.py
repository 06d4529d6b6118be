"""Prefill/decode disaggregation through the gateway with real vLLM CPU servers (issue 15, item 8).

A prefill and a decode vLLM server run vLLM's NixlConnector and ExampleConnector (conftest's
``vllm_pd_pair``). The gateway runs them as ``role: prefill`` / ``role: decode`` under a profile
that always disaggregates, once per handover:

* ``kv_transfer: nixl``: the prefill answers ``kv_transfer_params``, which the gateway passes to
  the decode; the decode pulls the prompt's KV from the prefill over NIXL (UCX over TCP).
* ``kv_transfer: shared``: the prefill saves the prompt's full 128-token KV blocks in the
  ExampleConnector's directory; the decode gets the client's body and finds them there by the
  prompt's tokens.

Checked each time, streamed and not: the client's answer equals the collocated answer of the
tier's FCFS vLLM server at temperature 0 (text and token counts), the headers name both engines,
the prefill server generated exactly one token, and the KV really moved: the decode server loaded
the prompt's KV instead of computing it (its external prefix-cache hits: every prompt token through
NIXL, with one NIXL transfer of some bytes; the whole blocks from the store, with a new prompt
folder written by the prefill and no NIXL transfer, the rest computed on the decode server).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.realengines.servers import RunningEngine
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.realengines.conftest import VLLM_PD_NAME, PdPair

pytestmark = pytest.mark.real_engines

BLOCK = 128  # vLLM CPU's block size: the ExampleConnector stores and loads whole blocks only
MAX_TOKENS = 24
#: one prompt per test, each over two blocks long and different from the first token on, so that
#: neither server has any of it cached already
PROMPTS = {
    ("nixl", False): "the quiet river runs under the old stone bridge and " * 32,
    ("nixl", True): "tell me about the cache, the weather in the hills and the sea " * 28,
    ("shared", False): "a small book of songs about snow on the city " * 32,
    ("shared", True): "why does the slow star sing to the happy cat " * 32,
}

PROFILE = """\
name: pd-real
filters: []
scorers:
  - name: least_load
    weight: 1.0
picker:
  name: max_score
disaggregation: {mode: always}
"""

CONFIG = """\
routing_profile: "{profile}"
monitor_interval_s: 0.25
engines:
  - {{name: vllm-prefill, url: "{prefill}", kind: vllm, model: {model}, role: prefill, kv_transfer: {kv}}}
  - {{name: vllm-decode, url: "{decode}", kind: vllm, model: {model}, role: decode}}
"""


@pytest.fixture(scope="module", params=["nixl", "shared"])
def pd_gateway(
    request: pytest.FixtureRequest, vllm_pd_pair: PdPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningGateway, str]]:
    """The gateway in front of the pair, and the prefill engine's ``kv_transfer`` (the param)."""
    kv: str = request.param
    root = tmp_path_factory.mktemp(f"pd-gw-{kv}")
    profile = root / "pd-real.yaml"
    profile.write_text(PROFILE)
    config = root / "gateway.yaml"
    config.write_text(
        CONFIG.format(
            profile=profile,
            prefill=vllm_pd_pair.prefill.url,
            decode=vllm_pd_pair.decode.url,
            model=VLLM_PD_NAME,
            kv=kv,
        )
    )
    with run_gateway(config_file=config) as gw:
        assert wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 200, timeout=10)
        yield gw, kv


#: vLLM series (summed over their labels) that show what each server did
COUNTERS = (
    "vllm:external_prefix_cache_hits_total",  # prompt tokens whose KV a connector loaded
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:nixl_bytes_transferred_count",  # NIXL transfers into this server
    "vllm:nixl_bytes_transferred_sum",
)


def counters(engine: RunningEngine) -> dict[str, float]:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    values = {}
    for name in COUNTERS:
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
        values[name.split(":", 1)[1]] = sum(float(value) for value in pattern.findall(text))
    return values


def stored_prefixes(storage: Path) -> dict[str, list[str]]:
    """The ExampleConnector's store: one folder per stored prompt prefix, one file per layer."""
    return {d.name: sorted(f.name for f in d.iterdir()) for d in storage.iterdir() if d.is_dir()}


def chat_body(model: str, prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def answer_of(response: httpx.Response, stream: bool) -> tuple[str, dict[str, Any]]:
    """Text and usage of a chat answer, streamed or not."""
    assert response.status_code == 200, response.text
    if not stream:
        data = response.json()
        return data["choices"][0]["message"]["content"], data["usage"]
    assert response.headers["content-type"].startswith("text/event-stream")
    text, usage = [], {}
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for choice in chunk.get("choices") or ():
            text.append(choice["delta"].get("content") or "")
        if chunk.get("usage"):
            usage = chunk["usage"]
    assert response.text.rstrip().endswith("data: [DONE]")
    return "".join(text), usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_answer_equals_collocated_and_the_kv_moved(
    pd_gateway: tuple[RunningGateway, str], vllm_pd_pair: PdPair, vllm_fcfs: RunningEngine, stream: bool
) -> None:
    gateway, kv = pd_gateway
    prompt = PROMPTS[kv, stream]
    direct = httpx.post(
        vllm_fcfs.url + "/v1/chat/completions", json=chat_body(vllm_fcfs.model, prompt, False), timeout=120
    )
    reference, reference_usage = answer_of(direct, False)
    prompt_tokens = reference_usage["prompt_tokens"]
    # what the decode server loads instead of computing: NIXL pulls the KV of every prompt token;
    # the ExampleConnector keeps whole 128-token blocks and keys a prompt by its first
    # (len - 2) // 128 of them, the rest is computed on the decode server
    full_blocks = (prompt_tokens - 2) // BLOCK * BLOCK
    assert full_blocks >= 2 * BLOCK, prompt_tokens
    loaded = prompt_tokens if kv == "nixl" else full_blocks

    prefill, decode = vllm_pd_pair.prefill, vllm_pd_pair.decode
    prefill_before, decode_before = counters(prefill), counters(decode)
    stored_before = stored_prefixes(vllm_pd_pair.storage)

    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=chat_body(VLLM_PD_NAME, prompt, stream), timeout=120
    )
    text, usage = answer_of(response, stream)

    # the same answer as one collocated engine computing everything itself
    assert text == reference and text.strip()
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == reference_usage["completion_tokens"]
    assert response.headers["x-slogate-prefill-engine"] == "vllm-prefill"
    assert response.headers["x-slogate-engine"] == "vllm-decode"

    # what each server did, by its own counters (which settle a moment after the answer):
    # the prefill server computed the whole prompt and one token (the gateway's max_tokens 1) ...
    prefill_expected = {
        "external_prefix_cache_hits_total": 0,
        "generation_tokens_total": 1,
        "request_success_total": 1,
        "nixl_bytes_transferred_count": 0,
    }
    # ... and the decode server loaded the prompt's KV from outside instead of computing it
    decode_expected = {
        "external_prefix_cache_hits_total": loaded,
        "generation_tokens_total": usage["completion_tokens"],
        "request_success_total": 1,
        "nixl_bytes_transferred_count": 1 if kv == "nixl" else 0,
    }

    def moved(engine: RunningEngine, before: dict[str, float]) -> dict[str, float]:
        return {name: value - before[name] for name, value in counters(engine).items()}

    def settled() -> bool:
        for engine, before, expected in (
            (prefill, prefill_before, prefill_expected),
            (decode, decode_before, decode_expected),
        ):
            now = moved(engine, before)
            if {name: now[name] for name in expected} != expected:
                return False
        return True

    wait_until(settled, timeout=10, interval=0.2)
    prefill_moved, decode_moved = moved(prefill, prefill_before), moved(decode, decode_before)
    transferred = decode_moved.pop("nixl_bytes_transferred_sum")
    assert prefill_moved.pop("nixl_bytes_transferred_sum") == 0
    assert prefill_moved == prefill_expected, prefill_moved
    assert decode_moved == decode_expected, decode_moved
    stored_after = stored_prefixes(vllm_pd_pair.storage)
    new = {name: files for name, files in stored_after.items() if name not in stored_before}
    if kv == "nixl":
        # pulled from the prefill server over NIXL
        assert transferred > 0
    else:
        # read from the store, where the prefill server wrote it: a prompt folder, a file per layer
        assert transferred == 0
        assert len(new) == 1, (stored_before, stored_after)
        (files,) = new.values()
        assert files and all(f.endswith(".safetensors") for f in files), files
