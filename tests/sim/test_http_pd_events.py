"""P/D disaggregation (NIXL-style and bootstrap-style), KV events over ZMQ, the openai client."""

from __future__ import annotations

import asyncio
import random
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import openai
import pytest
import zmq

from gateway.sim.kv_cache import prefix_hashes
from tests.sim.helpers import MODEL, write_profile
from tests.sim.test_http_api import metric, post, stream
from tests.support.local_app import serving
from tests.support.sim_process import SimProcess, start_sim_engine

#: 1 ms link latency + 2000 tokens x 262,144 B / 10 GB/s = 53 ms of modelled transfer
PD_PROFILE = {
    "kv_bytes_per_token": 262144,
    "transfer": {"link_bandwidth_gbps": 10.0, "link_latency_s": 0.001},
}


@pytest.fixture(scope="module")
def pd_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SimProcess, SimProcess, SimProcess]]:
    path = write_profile(tmp_path_factory.mktemp("pd") / "pd.yaml", **PD_PROFILE)
    common = ("--profile", str(path), "--model", MODEL, "--time-scale", "1")
    with (
        start_sim_engine(*common, "--role", "prefill", "--engine-id", "p0") as p,
        start_sim_engine(*common, "--role", "decode", "--engine-id", "d0") as d,
        start_sim_engine(*common) as c,
    ):
        yield p, d, c


def _prompt(seed: int, n: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 36000) for _ in range(n)]


async def test_nixl_style_prefill_then_decode(pd_engines: tuple[SimProcess, SimProcess, SimProcess]) -> None:
    p, d, c = pd_engines
    prompt = _prompt(1)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
    _, collocated = await post(c.url + "/v1/completions", body)

    rid = uuid.uuid4().hex
    status, pre = await post(
        p.url + "/v1/completions",
        {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        },
        headers={"X-Request-Id": rid},
    )
    assert status == 200 and pre["choices"][0]["finish_reason"] == "length"
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p0" and len(params["remote_block_ids"]) == 2000 // 16 + 1
    assert {"remote_request_id", "remote_host", "remote_port", "tp_size"} <= set(params)
    assert await metric(p.url, "vllm:kv_cache_usage_perc") > 0  # held for the decode engine

    events, times, sent = await stream(
        d.url + "/v1/completions", {**body, "kv_transfer_params": params}, headers={"X-Request-Id": rid}
    )
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == collocated["choices"][0]["text"]
    transfer = 0.001 + 2000 * 262144 / 10e9
    prefill = 0.025 + 1e-4 * 2000 + 2e-9 * 2000**2
    ttft = times[0] - sent
    # paid the transfer, not the prefill (0.1 s of room for a loaded machine: 0.05 was passed)
    assert transfer < ttft < transfer + 0.1 < prefill
    assert await metric(p.url, "vllm:kv_cache_usage_perc") == 0.0  # P freed the blocks once read
    # the KV was consumed: a second decode with the same params cannot find it
    status, err = await post(d.url + "/v1/completions", {**body, "kv_transfer_params": params})
    assert status >= 400 and "error" in err


async def test_bootstrap_style_concurrent_prefill_and_decode(
    pd_engines: tuple[SimProcess, SimProcess, SimProcess],
) -> None:
    p, d, c = pd_engines
    prompt = _prompt(2)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": True}
    _, collocated = await post(c.url + "/v1/completions", body)
    host, port = p.url.removeprefix("http://").rsplit(":", 1)
    boot = {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": random.getrandbits(62)}
    start = time.perf_counter()
    (ps, pre), (ds, dec) = await asyncio.gather(
        post(p.url + "/v1/completions", {**body, **boot}),
        post(d.url + "/v1/completions", {**body, **boot}),
    )
    elapsed = time.perf_counter() - start
    assert ps == 200 and ds == 200, (pre, dec)
    assert dec["choices"][0]["text"] == collocated["choices"][0]["text"]
    prefill = 0.025 + 1e-4 * 2000 + 2e-9 * 2000**2
    assert elapsed > prefill + 0.001 + 2000 * 262144 / 10e9


# -- KV events --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drain(sub: zmq.Socket[bytes], until: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while time.monotonic() < until:
        if sub.poll(50):
            _topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            ts, batch, dp_rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and dp_rank == 0
            events += batch
    return events


async def test_kv_events_match_the_cache() -> None:
    port = _free_port()
    with start_sim_engine(
        "--profile",
        "qwen-7b",
        "--model",
        MODEL,
        "--time-scale",
        "10",
        "--num-gpu-blocks",
        "8",
        "--kv-events-endpoint",
        f"tcp://*:{port}",
    ) as proc:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        await asyncio.sleep(0.5)  # ZMQ slow joiner
        first = list(range(300, 364))  # 4 full blocks
        await post(proc.url + "/v1/completions", {"prompt": first, "max_tokens": 1})
        events = await asyncio.to_thread(_drain, sub, time.monotonic() + 0.5)
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored and stored[0]["block_hashes"] == prefix_hashes(first, 16)
        assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == first
        assert stored[0]["block_size"] == 16 and stored[0]["medium"] == "GPU"
        assert {"lora_id", "lora_name"} <= set(stored[0])
        # a different 100-token prompt needs 7 of the 8 blocks: the first prompt's blocks go
        await post(proc.url + "/v1/completions", {"prompt": list(range(1000, 1100)), "max_tokens": 1})
        events = await asyncio.to_thread(_drain, sub, time.monotonic() + 0.5)
        removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
        assert removed and removed <= set(prefix_hashes(first, 16))
        stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert stored[:6] == prefix_hashes(list(range(1000, 1100)), 16)
        async with __import__("aiohttp").ClientSession() as s, s.post(proc.url + "/reset_prefix_cache") as r:
            assert (await r.json())["success"] is True
        events = await asyncio.to_thread(_drain, sub, time.monotonic() + 0.5)
        assert {"type": "AllBlocksCleared"} in events
        sub.close()
        ctx.term()


# -- the official openai client ---------------------------------------------------------------


def test_openai_client_stream_and_not(engine: SimProcess) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    models = client.models.list()
    assert models.data[0].id == MODEL
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens <= 5
    pieces = []
    usage = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, extra_body={"ignore_eos": True})
    assert (
        comp.choices[0].finish_reason == "length"
        and comp.usage is not None
        and comp.usage.completion_tokens == 4
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="abc", max_tokens=4)


async def test_kv_held_for_a_decode_that_never_reads_it_is_freed_at_its_lease_while_idle() -> None:
    """The lease on KV a prefill holds for its decode engine ended only at the next engine step:
    an idle engine kept the blocks (and reported the KV use) until unrelated work came. A room
    nobody waited on left an event behind for every bootstrap prefill."""
    from gateway.sim.metrics import engine_state
    from gateway.sim.server import HELD_LEASE_S, SimConfig, SimServer
    from tests.sim.helpers import profile

    scale = 100.0  # the lease: 30 simulated seconds, 0.3 s here
    server = SimServer(SimConfig(profile=profile(), model=MODEL, time_scale=scale, role="prefill"))
    await server.start()
    try:
        body = {"model": MODEL, "prompt": _prompt(3, 200), "max_tokens": 1}
        status, _ = await post(
            server.url + "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert status == 200
        status, _ = await post(server.url + "/v1/completions", {**body, "bootstrap_room": 7})
        assert status == 200
        assert len(server.model.held) == 2 and engine_state(server.model).kv_usage > 0
        assert server.rooms == {}  # nobody waited on room 7
        await asyncio.sleep(HELD_LEASE_S / scale * 3)
        assert server.model.held == {} and engine_state(server.model).kv_usage == 0.0
    finally:
        await server.stop()


async def test_a_bootstrap_room_used_again_frees_the_kv_the_first_prefill_held() -> None:
    """A second prefill in the same room replaced the first's held entry without freeing its
    blocks: nothing could pull or expire them any more, and the engine's KV stayed in use."""
    from gateway.sim.metrics import engine_state
    from gateway.sim.server import HELD_LEASE_S, SimConfig, SimServer
    from tests.sim.helpers import profile

    scale = 100.0
    server = SimServer(SimConfig(profile=profile(), model=MODEL, time_scale=scale, role="prefill"))
    await server.start()
    try:
        for seed in (3, 4):
            body = {"model": MODEL, "prompt": _prompt(seed, 200), "max_tokens": 1, "bootstrap_room": 7}
            status, _ = await post(server.url + "/v1/completions", body)
            assert status == 200
        assert list(server.model.held) == ["room:7"]
        one = server.model.held["room:7"]
        cache = server.model.cache
        held_blocks = cache.num_blocks - cache.available
        assert held_blocks == len(one.seq.blocks), "only the last prefill's KV is held"
        await asyncio.sleep(HELD_LEASE_S / scale * 3)
        assert server.model.held == {} and engine_state(server.model).kv_usage == 0.0
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "answer",
    [
        (200, b"<html>not an engine</html>"),
        (200, b'{"ok": true}'),
        (200, b'{"tokens": "many"}'),
        (500, b"oops"),
    ],
    ids=["html", "no-tokens", "tokens-not-int", "error"],
)
async def test_a_kv_source_that_is_no_engine_is_a_clean_error_not_a_500(answer: tuple[int, bytes]) -> None:
    """The KV source is whatever the request names: an answer that was not JSON, or JSON without
    a token count, raised past the handler (a plain-text 500)."""
    from aiohttp import web

    from gateway.sim.server import SimConfig, SimServer
    from tests.sim.helpers import profile

    status_code, raw = answer

    async def pull(_: web.Request) -> web.Response:
        return web.Response(status=status_code, body=raw)

    app = web.Application()
    app.router.add_post("/sim/kv/pull", pull)
    async with serving(app) as port:
        server = SimServer(SimConfig(profile=profile(), model=MODEL, time_scale=100.0, role="decode"))
        await server.start()
        try:
            remote = {
                "do_remote_prefill": True,
                "remote_host": "127.0.0.1",
                "remote_port": port,
                "remote_request_id": "r",
            }
            for fields in (
                {"kv_transfer_params": remote},
                {"bootstrap_room": 1, "bootstrap_host": "127.0.0.1", "bootstrap_port": port},
            ):
                status, body = await post(
                    server.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **fields}
                )
                assert status in (400, 502), body
                assert isinstance(body, dict) and set(body["error"]) >= {"message", "code"}, body
        finally:
            await server.stop()
