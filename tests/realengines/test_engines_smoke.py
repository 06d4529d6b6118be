"""Smoke tests against real engines: OpenAI endpoints, streaming, metrics names, exact continuation."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from gateway.realengines.servers import RunningEngine

pytestmark = pytest.mark.real_engines

MESSAGES = [{"role": "user", "content": "hello, tell me about the cache"}]


def get_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def post_sse(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[list[dict[str, Any]], bool]:
    """POST a streaming request; return the parsed ``data:`` events and whether ``[DONE]`` came last."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    events: list[dict[str, Any]] = []
    done = False
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert "text/event-stream" in resp.headers.get("Content-Type", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                done = True
                continue
            assert not done, "event after [DONE]"
            events.append(json.loads(payload))
    return events, done


def chat_body(engine: RunningEngine, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": engine.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    body.update(extra)
    return body


def test_models_lists_served_name(any_engine: RunningEngine) -> None:
    data = json.loads(get_text(f"{any_engine.url}/v1/models"))
    assert data["object"] == "list"
    assert any_engine.model in [m["id"] for m in data["data"]]


def test_chat_non_streaming_is_deterministic(any_engine: RunningEngine) -> None:
    first = post_json(f"{any_engine.url}/v1/chat/completions", chat_body(any_engine))
    second = post_json(f"{any_engine.url}/v1/chat/completions", chat_body(any_engine))
    text = first["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip()
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    assert first["usage"]["completion_tokens"] > 0 and first["usage"]["prompt_tokens"] > 0
    assert second["choices"][0]["message"]["content"] == text
    # Readable-output trick: only words and punctuation come out.
    assert all(ch.isalpha() or ch in " .,!?" for ch in text), text


def test_chat_streaming_matches_non_streaming(any_engine: RunningEngine) -> None:
    whole = post_json(f"{any_engine.url}/v1/chat/completions", chat_body(any_engine))
    events, done = post_sse(
        f"{any_engine.url}/v1/chat/completions",
        chat_body(any_engine, stream=True, stream_options={"include_usage": True}),
    )
    assert done
    text = "".join(
        (choice.get("delta") or {}).get("content") or "" for ev in events for choice in ev.get("choices", [])
    )
    assert text == whole["choices"][0]["message"]["content"]
    finish = [c["finish_reason"] for ev in events for c in ev.get("choices", []) if c.get("finish_reason")]
    assert finish == [whole["choices"][0]["finish_reason"]]
    usage = [ev["usage"] for ev in events if ev.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == whole["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    "names",
    [
        (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds",
        )
    ],
)
def test_vllm_metrics_names(vllm_fcfs: RunningEngine, names: tuple[str, ...]) -> None:
    post_json(f"{vllm_fcfs.url}/v1/chat/completions", chat_body(vllm_fcfs, max_tokens=2))
    text = get_text(f"{vllm_fcfs.url}/metrics")
    missing = [n for n in names if n not in text]
    assert not missing, missing


def test_llamacpp_metrics_names(llamacpp_server: RunningEngine) -> None:
    post_json(f"{llamacpp_server.url}/v1/chat/completions", chat_body(llamacpp_server, max_tokens=2))
    text = get_text(f"{llamacpp_server.url}/metrics")
    names = (
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
    )
    missing = [n for n in names if n not in text]
    assert not missing, missing


def test_llamacpp_slots(llamacpp_server: RunningEngine) -> None:
    slots = json.loads(get_text(f"{llamacpp_server.url}/slots"))
    assert isinstance(slots, list) and len(slots) == 2


def test_vllm_return_token_ids_continuation_is_exact(vllm_fcfs: RunningEngine) -> None:
    max_tokens = 16
    full = post_json(
        f"{vllm_fcfs.url}/v1/chat/completions",
        chat_body(vllm_fcfs, max_tokens=max_tokens, return_token_ids=True),
    )
    choice = full["choices"][0]
    prompt_ids = full.get("prompt_token_ids") or choice.get("prompt_token_ids")
    out_ids = choice["token_ids"]
    assert prompt_ids and all(isinstance(t, int) for t in prompt_ids)
    assert len(out_ids) == full["usage"]["completion_tokens"] >= 4
    for k in (1, len(out_ids) // 2):
        cont = post_json(
            f"{vllm_fcfs.url}/v1/completions",
            {
                "model": vllm_fcfs.model,
                "prompt": prompt_ids + out_ids[:k],
                "max_tokens": max_tokens - k,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert cont["choices"][0]["token_ids"] == out_ids[k:]
        assert cont["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_vllm_streaming_token_ids(vllm_fcfs: RunningEngine) -> None:
    whole = post_json(f"{vllm_fcfs.url}/v1/chat/completions", chat_body(vllm_fcfs, return_token_ids=True))
    events, _ = post_sse(
        f"{vllm_fcfs.url}/v1/chat/completions", chat_body(vllm_fcfs, stream=True, return_token_ids=True)
    )
    streamed = [t for ev in events for c in ev.get("choices", []) for t in (c.get("token_ids") or [])]
    assert streamed == whole["choices"][0]["token_ids"]


def test_vllm_prefix_cache_reports_cached_tokens(vllm_fcfs: RunningEngine) -> None:
    long_text = " ".join(["the quiet river runs under the old stone bridge"] * 40)
    body = chat_body(vllm_fcfs, messages=[{"role": "user", "content": long_text}], max_tokens=1)
    post_json(f"{vllm_fcfs.url}/v1/chat/completions", body)
    again = post_json(f"{vllm_fcfs.url}/v1/chat/completions", body)
    cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= 128 and cached % 128 == 0  # whole 128-token blocks on the CPU backend


def test_vllm_priority_field_accepted(vllm_priority: RunningEngine) -> None:
    resp = post_json(f"{vllm_priority.url}/v1/chat/completions", chat_body(vllm_priority, priority=5))
    assert resp["choices"][0]["message"]["content"]
    log = vllm_priority.log_path.read_text(errors="replace")
    assert "priority" in " ".join(vllm_priority.command)
    assert "Traceback" not in log


def test_vllm_keeps_its_temporary_files_in_a_directory_of_its_own(vllm_fcfs: RunningEngine) -> None:
    """vLLM leaves IPC sockets and torch's rendezvous files (vllm_dist_*) in the temporary
    directory; each server gets its own (removed when it stops), so runs do not pile them up in
    /tmp."""
    assert vllm_fcfs.scratch is not None and vllm_fcfs.scratch.is_dir()
    assert any(vllm_fcfs.scratch.iterdir()), "vLLM wrote nothing to its TMPDIR: is it read?"
