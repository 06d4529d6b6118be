"""The gateway in front of real engines: two vLLM CPU servers and one llama-server, driven by the openai SDK.

The gateway reads a config file written the way a user writes one. Every assertion compares what the
gateway did with what the real engine reports about itself (its ``/metrics``, its own answers).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.engines.llamacpp import parse_llamacpp_metrics
from gateway.engines.vllm import parse_vllm_metrics
from gateway.realengines.servers import RunningEngine, start_llamacpp
from policies.api import EngineState
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.realengines.conftest import LLAMACPP_NAME, VLLM_SHARED_NAME

pytestmark = pytest.mark.real_engines

MESSAGES = [{"role": "user", "content": "hello, tell me about the cache"}]
LONG_TEXT = " ".join(["the quiet river runs under the old stone bridge"] * 40)

CONFIG = """\
# gateway.yaml: two vLLM servers behind one model name, and a llama.cpp server
routing_profile: least-load
monitor_interval_s: 0.25
engines:
  - {{name: vllm-fcfs, url: "{fcfs}", kind: vllm, model: {shared}}}
  - {{name: vllm-prio, url: "{prio}", kind: vllm, model: {shared}, priority_scheduling: true}}
  - {{name: llama, url: "{llama}", kind: llamacpp, model: {llama_name}}}
"""


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def gateway(
    vllm_servers: dict[str, RunningEngine],
    llamacpp_server: RunningEngine,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningGateway]:
    text = CONFIG.format(
        fcfs=vllm_servers["fcfs"].url,
        prio=vllm_servers["priority"].url,
        llama=llamacpp_server.url,
        shared=VLLM_SHARED_NAME,
        llama_name=LLAMACPP_NAME,
    )
    config = write_config(tmp_path_factory.mktemp("gw") / "gateway.yaml", text)
    with run_gateway(config_file=config) as gw:
        assert wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 200, timeout=10)
        yield gw


def client(gw: RunningGateway, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def engine_state(engine: RunningEngine) -> EngineState:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return parse_llamacpp_metrics(text) if engine.kind == "llamacpp" else parse_vllm_metrics(text)


def gateway_view(gw: RunningGateway) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in httpx.get(gw.url + "/admin/engines", timeout=10).json()["engines"]}


def direct_chat(engine: RunningEngine, **extra: Any) -> dict[str, Any]:
    body = {"model": engine.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 16, **extra}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


# -- the SDK through the gateway ---------------------------------------------------------------


@pytest.mark.parametrize("model", [VLLM_SHARED_NAME, LLAMACPP_NAME])
def test_sdk_chat_stream_and_not_match_the_engine(
    gateway: RunningGateway, llamacpp_server: RunningEngine, vllm_fcfs: RunningEngine, model: str
) -> None:
    sdk = client(gateway)
    engine = llamacpp_server if model == LLAMACPP_NAME else vllm_fcfs
    direct = direct_chat(engine)["choices"][0]["message"]["content"]

    raw = sdk.chat.completions.with_raw_response.create(
        model=model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=16,  # type: ignore[arg-type]
    )
    whole = raw.parse()
    assert raw.headers["x-slogate-engine"] in {"vllm-fcfs", "vllm-prio", "llama"}
    assert raw.headers["x-request-id"]
    assert whole.choices[0].message.content == direct  # same weights, temperature 0: same text
    assert whole.usage is not None and whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0

    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    # the gateway asks upstream for usage on every stream, and hides it from clients who did not ask
    plain = list(
        sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=16,
            stream=True,  # type: ignore[arg-type]
        )
    )
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == direct


@pytest.mark.parametrize("model", [VLLM_SHARED_NAME, LLAMACPP_NAME])
async def test_async_sdk_completions(gateway: RunningGateway, model: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    whole = await sdk.completions.create(model=model, prompt="the old stone", temperature=0, max_tokens=12)
    assert whole.choices[0].text and whole.usage is not None
    stream = await sdk.completions.create(
        model=model, prompt="the old stone", temperature=0, max_tokens=12, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == whole.choices[0].text
    await sdk.close()


def test_sdk_errors_map_to_the_right_exceptions(gateway: RunningGateway) -> None:
    sdk = client(gateway)
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert "no-such-model" in not_found.value.message
    # vLLM runs with --max-model-len 2048: a longer prompt is the engine's 400, passed through
    too_long = " ".join(["river"] * 5000)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=VLLM_SHARED_NAME, prompt=too_long, max_tokens=4)
    assert bad.value.status_code == 400
    # llama.cpp: 2 slots share -c 8192, so 4096 tokens per request; the prompt is 5000
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=LLAMACPP_NAME, prompt=too_long, max_tokens=4)
    # the gateway's own validation
    with pytest.raises(openai.BadRequestError) as own:
        sdk.chat.completions.create(model=VLLM_SHARED_NAME, messages=[], max_tokens=4)
    assert own.value.status_code == 400


# -- metrics and routing --------------------------------------------------------------------------


def _load(engine: RunningEngine, n: int, max_tokens: int, stop: threading.Event) -> list[threading.Thread]:
    """``n`` streams sent straight to ``engine`` (not through the gateway), each re-sent when it ends,
    until ``stop`` is set (llama.cpp finishes 1500 tokens in about a second)."""

    def one() -> None:
        body = {
            "model": engine.model,
            "prompt": "the quiet river",  # short: prompt + max_tokens must fit the 2048-token context
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        while not stop.is_set():
            with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=300) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_engine_state_is_scraped_under_load_and_least_load_routes_away(
    gateway: RunningGateway, vllm_fcfs: RunningEngine, llamacpp_server: RunningEngine
) -> None:
    stop = threading.Event()
    threads = _load(vllm_fcfs, 5, 1500, stop) + _load(llamacpp_server, 1, 1500, stop)
    try:
        # --max-num-seqs 2: two run, three wait; the gateway's scrape must show it
        assert wait_until(
            lambda: (gateway_view(gateway)["vllm-fcfs"]["state"] or {}).get("num_waiting", 0) >= 3,
            timeout=60,
            interval=0.1,
        ), gateway_view(gateway)["vllm-fcfs"]
        view = gateway_view(gateway)
        fcfs = view["vllm-fcfs"]["state"]
        assert fcfs["num_running"] == 2 and fcfs["kv_usage"] > 0, fcfs
        assert fcfs["block_size"] and fcfs["num_gpu_blocks"], fcfs

        def llama_busy() -> dict[str, Any] | None:
            state: dict[str, Any] = gateway_view(gateway)["llama"]["state"] or {}
            return state if state.get("kv_usage", 0) > 0 and state.get("num_running") == 1 else None

        assert wait_until(lambda: llama_busy() is not None, timeout=30), gateway_view(gateway)["llama"]
        llama = llama_busy() or gateway_view(gateway)["llama"]["state"]
        # llama-server publishes no KV gauge: use and capacity come from its /slots (2 slots x 4096)
        assert llama["num_gpu_blocks"] == 8192 and llama["block_size"] == 1, llama
        # least load: the other vLLM server takes every request for the shared model
        sdk = client(gateway)
        served = []
        for _ in range(4):
            raw = sdk.chat.completions.with_raw_response.create(
                model=VLLM_SHARED_NAME,
                messages=MESSAGES,
                temperature=0,
                max_tokens=4,  # type: ignore[arg-type]
            )
            served.append(raw.headers["x-slogate-engine"])
        assert served == ["vllm-prio"] * 4
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert wait_until(lambda: engine_state(vllm_fcfs).num_running == 0, timeout=30)
    # and once the load is gone both servers are used again
    assert wait_until(
        lambda: (gateway_view(gateway)["vllm-fcfs"]["state"] or {}).get("num_waiting", 1) == 0, timeout=10
    )
    sdk = client(gateway)
    with ThreadPoolExecutor(4) as pool:
        heads = list(
            pool.map(
                lambda _: sdk.chat.completions.with_raw_response.create(
                    model=VLLM_SHARED_NAME,
                    messages=MESSAGES,
                    temperature=0,
                    max_tokens=32,  # type: ignore[arg-type]
                ).headers["x-slogate-engine"],
                range(8),
            )
        )
    assert set(heads) == {"vllm-fcfs", "vllm-prio"}, heads


@pytest.mark.parametrize("engine_name", ["vllm-fcfs", "llama"])
def test_prefix_cache_hits_reach_engine_state(
    gateway: RunningGateway, vllm_fcfs: RunningEngine, llamacpp_server: RunningEngine, engine_name: str
) -> None:
    engine = vllm_fcfs if engine_name == "vllm-fcfs" else llamacpp_server
    before = (gateway_view(gateway)[engine_name]["state"] or {}).get("prefix_hits", 0.0)
    body = {"model": engine.model, "prompt": LONG_TEXT + " again", "max_tokens": 1, "temperature": 0}
    for _ in range(2):
        httpx.post(engine.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    assert wait_until(
        lambda: (gateway_view(gateway)[engine_name]["state"] or {}).get("prefix_hits", 0.0) > before,
        timeout=10,
    ), gateway_view(gateway)[engine_name]


# -- engine-side priority -------------------------------------------------------------------------


def _admission_order(
    gw: RunningGateway, model: str, low: int, max_tokens: int, engine: RunningEngine
) -> list[str]:
    """Send ``low`` priority-3 streams, wait until the engine queues some, then one priority-0 stream;
    return the labels in the order the engine started them (first streamed token).

    First tokens, not completions: on this 2-core machine vLLM's non-streamed answers leave in
    bursts under concurrency, while streamed tokens arrive steadily (~5 ms apart)."""
    sdk = client(gw, timeout=300)
    started: dict[str, float] = {}

    def send(label: str, priority: int) -> None:
        stream = sdk.completions.create(
            model=model,
            prompt=f"request {label}",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"x-priority": str(priority)},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and label not in started:
                started[label] = time.monotonic()

    with ThreadPoolExecutor(low + 1) as pool:
        futures = [pool.submit(send, f"low{i}", 3) for i in range(low)]
        queued = wait_until(lambda: engine_state(engine).num_waiting >= low - 2, timeout=60, interval=0.05)
        assert queued, ([f.exception(0) if f.done() else "running" for f in futures], engine_state(engine))
        futures.append(pool.submit(send, "p0", 0))
        for f in futures:
            f.result()
    return sorted(started, key=started.__getitem__)


@pytest.mark.alone  # (which request vLLM starts first)
def test_priority_zero_overtakes_a_queue_on_a_priority_engine(
    vllm_priority: RunningEngine, vllm_fcfs: RunningEngine, tmp_path: Path
) -> None:
    def config(engine: RunningEngine, name: str, priority_scheduling: bool) -> Path:
        return write_config(
            tmp_path / f"{name}.yaml",
            f'slo_profile: priority\nengines:\n  - {{name: {name}, url: "{engine.url}", kind: vllm, '
            f"model: {VLLM_SHARED_NAME}, priority_scheduling: {str(priority_scheduling).lower()}}}\n",
        )

    with run_gateway(config_file=config(vllm_priority, "prio", True)) as gw:
        order = _admission_order(gw, VLLM_SHARED_NAME, 6, 400, vllm_priority)
    # two low ones were already running; p0 takes the next free slot, ahead of the four waiting
    assert order.index("p0") <= 3, order
    # the same traffic on an FCFS engine: p0 waits behind the whole queue (the test can fail)
    with run_gateway(config_file=config(vllm_fcfs, "fcfs", False)) as gw:
        control = _admission_order(gw, VLLM_SHARED_NAME, 6, 400, vllm_fcfs)
    assert control.index("p0") >= 5, control


# -- disconnects and failures ---------------------------------------------------------------------


def tokens_generated(engine: RunningEngine) -> float:
    """The engine's own count of tokens it has decoded, aborted requests included."""
    name = "llamacpp:n_decode_total" if engine.kind == "llamacpp" else "vllm:generation_tokens_total"
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("model", [VLLM_SHARED_NAME, LLAMACPP_NAME])
def test_client_disconnect_aborts_the_real_engine_request(
    gateway: RunningGateway,
    vllm_servers: dict[str, RunningEngine],
    llamacpp_server: RunningEngine,
    model: str,
) -> None:
    by_id = {
        "vllm-fcfs": vllm_servers["fcfs"],
        "vllm-prio": vllm_servers["priority"],
        "llama": llamacpp_server,
    }
    # as long as each engine allows: vLLM (max-model-len 2048) needs seconds for 1500 tokens, llama.cpp
    # decodes ~1,250 tokens/s and gets 4000 (its slot holds 4096)
    max_tokens = 4000 if model == LLAMACPP_NAME else 1500
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    before = {name: tokens_generated(engine) for name, engine in by_id.items()}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", gateway.url + "/v1/chat/completions", json=body) as r,
    ):
        name = r.headers["x-slogate-engine"]
        engine = by_id[name]
        chunks = r.iter_bytes()
        seen = 0
        while seen < 5:
            seen += next(chunks).count(b"data: ")
        assert engine_state(engine).num_running == 1
        closed_at = time.monotonic()
    assert wait_until(lambda: engine_state(engine).num_running == 0, timeout=10, interval=0.02)
    abort_s = time.monotonic() - closed_at
    assert abort_s < 2.0, abort_s
    # the engine stopped because the gateway aborted it, not because it had finished
    generated = tokens_generated(engine) - before[name]
    assert 5 <= generated < 0.75 * max_tokens, generated
    time.sleep(0.3)
    assert tokens_generated(engine) - before[name] == generated


def test_killed_engine_is_ejected_and_requests_keep_succeeding(tmp_path: Path) -> None:
    alias = "tiny-llamacpp-pair"
    a = start_llamacpp(alias)
    b = start_llamacpp(alias)
    try:
        config = write_config(
            tmp_path / "pair.yaml",
            "monitor_interval_s: 0.2\nengines:\n"
            f'  - {{name: a, url: "{a.url}", kind: llamacpp, model: {alias}}}\n'
            f'  - {{name: b, url: "{b.url}", kind: llamacpp, model: {alias}}}\n',
        )
        with run_gateway(config_file=config) as gw:
            sdk = client(gw, timeout=60)

            def ask(i: int) -> str:
                raw = sdk.chat.completions.with_raw_response.create(
                    model=alias,
                    messages=[{"role": "user", "content": f"hello {i}"}],
                    max_tokens=24,
                    temperature=0,
                )
                assert raw.parse().choices[0].message.content
                return raw.headers["x-slogate-engine"]

            with ThreadPoolExecutor(4) as pool:
                first = list(pool.map(ask, range(8)))
                assert set(first) == {"a", "b"}
                killed_at = time.monotonic()
                os.kill(a.pid, signal.SIGKILL)
                pending = [pool.submit(ask, i) for i in range(8, 40)]
                # ejected while the requests run: timed from the kill to the ejection, not to the
                # end of 32 CPU completions, which took 27 s in one full suite run on a busy machine
                assert wait_until(lambda: gateway_view(gw)["a"]["healthy"] is False, timeout=10)
                ejected_after = time.monotonic() - killed_at
                after = [f.result() for f in pending]  # every one succeeds (ask asserts)
            assert ejected_after < 10
            assert after[-8:] == ["b"] * 8
    finally:
        a.stop()
        b.stop()


def test_sdk_responses_stream_continue_and_read_on_real_vllm(gateway: RunningGateway) -> None:
    """The Responses API on real vLLM servers (with their response store on): the answer
    streamed and not is the same at temperature 0, and a conversation continued with
    previous_response_id stays on the server that stored it (the other one answers 404: it never
    saw that response), its prompt growing by the turns the server kept."""
    sdk = client(gateway)
    ask: dict[str, Any] = {"model": VLLM_SHARED_NAME, "max_output_tokens": 8, "temperature": 0}
    raw = sdk.responses.with_raw_response.create(input="hello there", **ask)
    first, home = raw.parse(), raw.headers["x-slogate-engine"]
    assert first.status in ("completed", "incomplete") and first.usage is not None
    with sdk.responses.stream(input="hello there", **ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == first.output_text
    assert streamed.usage is not None and streamed.usage.input_tokens == first.usage.input_tokens
    previous, inputs = first, [first.usage.input_tokens]
    for turn in range(3):
        raw = sdk.responses.with_raw_response.create(
            input=f"and turn {turn}?", previous_response_id=previous.id, **ask
        )
        answer = raw.parse()
        assert raw.headers["x-slogate-engine"] == home, f"turn {turn} left {home}"
        assert answer.usage is not None and answer.usage.input_tokens > inputs[-1]
        inputs.append(answer.usage.input_tokens)
        previous = answer
    assert sdk.responses.retrieve(first.id).output_text == first.output_text
    other = next(e for e in gateway_view(gateway) if e.startswith("vllm") and e != home)
    url = gateway_view(gateway)[other]["url"]
    assert httpx.get(f"{url}/v1/responses/{first.id}", timeout=10).status_code == 404
