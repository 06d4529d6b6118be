"""LoRA adapters: the monitor reads each engine's loaded adapters off its ``/v1/models``; a request
naming an adapter is served by the engines of its base model that have it loaded, under every
profile (the router's LoRA affinity; HyperFlexis's placements corrected at the dispatch loop); its
prompt is rooted apart from the base model's in the prefix index. End to end against simulated
engines, one started with ``--lora-modules`` and one that loads the adapter at runtime."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import pytest
from aiohttp import web

from gateway import metrics
from gateway.dispatch.core import ClassLimits, DispatchCore
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.offline import offline_fleet
from gateway.engines import adapter_for
from gateway.engines.base import adapters_listed, context_length
from gateway.fleet.block_hash import root_key
from gateway.fleet.monitor import FleetMonitor
from gateway.fleet.prompt_key import prompt_blocks
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.procs import ChildProcess, spawn_sim_engine
from gateway.router import Router, load_pipeline
from gateway.settings import EngineConfig
from policies.api import RequestView
from policies.hyperflexis import HyperFlexisParams
from policies.latency_fit import DEFAULT_DECODE, DEFAULT_PREFILL
from policies.pipeline import compile_profile
from policies.queue_order import make_order
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.support.threaded_app import ThreadedApp

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "routing"

#: GET /v1/models of ``vllm serve Qwen/Qwen2.5-7B --served-model-name m --enable-lora
#: --lora-modules a1=/adapters/a1 a2=/adapters/a2`` (vLLM's ModelList / ModelCard fields)
VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "m",
            "object": "model",
            "created": 1735689600,
            "owned_by": "vllm",
            "root": "Qwen/Qwen2.5-7B",
            "parent": None,
            "max_model_len": 32768,
            "permission": [
                {
                    "id": "modelperm-6d3c1b1d2b5f4c09a6a0e1f2a3b4c5d6",
                    "object": "model_permission",
                    "created": 1735689600,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        },
        {
            "id": "a1",
            "object": "model",
            "created": 1735689600,
            "owned_by": "vllm",
            "root": "/adapters/a1",
            "parent": "m",
            "max_model_len": None,
            "permission": [],
        },
        {
            "id": "a2",
            "object": "model",
            "created": 1735689600,
            "owned_by": "vllm",
            "root": "/adapters/a2",
            "parent": "m",
            "max_model_len": None,
            "permission": [],
        },
    ],
}


def test_adapters_are_read_off_vllm_s_model_list() -> None:
    assert adapters_listed(VLLM_MODELS, "m") == {"a1", "a2"}
    assert adapters_listed(VLLM_MODELS, "other") == frozenset()  # not this engine's model
    # another base the upstream lists (an alias, or another model behind a router): its
    # adapters are not this model's to route (under this model's key and SLO)
    aliases = {
        "data": [{"id": "m0", "parent": None}, {"id": "m", "parent": None}, {"id": "a1", "parent": "m0"}]
    }
    assert adapters_listed(aliases, "m") == frozenset()
    assert adapters_listed(aliases, "m0") == {"a1"}
    # SGLang (recent): the same cards; a bare array works too
    sglang = [{"id": "m", "root": "m", "max_model_len": 4096}, {"id": "a1", "root": "/a1", "parent": "m"}]
    assert adapters_listed({"object": "list", "data": sglang}, "m") == {"a1"}
    assert adapters_listed(sglang, "m") == {"a1"}
    # llama.cpp and generic servers: no parent, no adapters; junk is no adapters either
    llamacpp = {
        "object": "list",
        "data": [{"id": "m", "object": "model", "owned_by": "llamacpp", "meta": {}}],
    }
    assert adapters_listed(llamacpp, "m") == frozenset()
    for junk in (None, "x", {"data": "x"}, {"data": [1, {"id": 3, "parent": "m"}, {"parent": "m"}]}):
        assert adapters_listed(junk, "m") == frozenset()


def test_the_context_length_is_read_off_the_model_s_card() -> None:
    """What a continuation without a client bound may ask for (migration.py)."""
    assert context_length(VLLM_MODELS, "m") == 32768
    assert context_length(VLLM_MODELS, "a1") is None  # (null on an adapter's card)
    assert context_length([{"id": "m", "max_model_len": 4096}], "m") == 4096
    for junk in (None, {"data": [{"id": "m", "max_model_len": True}]}, [{"id": "m", "max_model_len": "9"}]):
        assert context_length(junk, "m") is None


# -- the monitor ------------------------------------------------------------------------------------


class ModelsEngine(ThreadedApp):
    """A vLLM-shaped engine whose /v1/models can be told to change, fail or hang."""

    thread_name = "models-engine"

    def __init__(self) -> None:
        super().__init__()
        self.models: Any = VLLM_MODELS
        self.status = 200
        self.hang = False
        self.hits = 0
        self._release = asyncio.Event()

    async def before_cleanup(self) -> None:
        self._release.set()

    async def build(self) -> web.Application:
        async def models(_: web.Request) -> web.Response:
            self.hits += 1
            if self.hang:
                await self._release.wait()
            if self.status != 200:
                return web.Response(status=self.status, text="no")
            return web.json_response(self.models)

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="vllm:num_requests_running 0\n")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", ok)
        return app


@pytest.fixture
def models_engine() -> Iterator[ModelsEngine]:
    with ModelsEngine() as engine:
        yield engine


async def test_the_monitor_records_adapters_and_a_failed_read_never_ejects(
    models_engine: ModelsEngine,
) -> None:
    async with aiohttp.ClientSession() as session:
        config = EngineConfig.model_validate(
            {"url": models_engine.url, "kind": "vllm", "model": "m", "name": "e"}
        )
        fleet = Fleet([adapter_for(config, session, 1.0, scrape_timeout_s=0.3)], 3.0)
        monitor = FleetMonitor(fleet, 0.05, 1, 1, scrape_timeout_s=0.3)
        changes: list[str] = []
        fleet.listeners.append(lambda engine_id, what: changes.append(what))
        monitor.start()
        try:
            # the first round (what the gateway waits for before serving) includes the adapters
            await asyncio.wait_for(monitor.first_round.wait(), 5)
            record = fleet.records["e"]
            assert record.adapters == {"a1", "a2"} and fleet.adapter_base("a1") == "m"
            assert fleet.engine_snapshot("e").adapters == {"a1", "a2"} and "adapters" in changes
            assert fleet.adapter_base("m") is None and fleet.adapter_base("nope") is None

            # failing and hanging reads keep the adapters and never count against health
            for status, hang, reason in ((500, False, "HTTP 500"), (200, True, "timed out")):
                models_engine.status, models_engine.hang = status, hang
                assert await _until(lambda r=reason: monitor.adapter_errors.get("e", "").startswith(r))
                assert record.healthy and record.consecutive_failures == 0
                assert record.adapters == {"a1", "a2"}

            # an unload shows at the next read
            models_engine.status, models_engine.hang = 200, False
            models_engine.models = {"data": VLLM_MODELS["data"][:2]}
            assert await _until(lambda: record.adapters == {"a1"} and "e" not in monitor.adapter_errors)
            assert fleet.adapter_bases == {"a1": "m"}
            # an engine without a model list (404) has none
            models_engine.status = 404
            assert await _until(lambda: record.adapters == frozenset())
            assert fleet.adapter_base("a1") is None and record.healthy
        finally:
            await monitor.stop()


async def _until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


# -- the router and the dispatch loop -------------------------------------------------------------


def _lora_fleet() -> Fleet:
    """Four engines of model m; m-1 and m-3 have adapter a1 loaded."""
    fleet = offline_fleet({MODEL: 4})
    fleet.set_adapters("m-1", frozenset({"a1"}))
    fleet.set_adapters("m-3", frozenset({"a1", "a2"}))
    return fleet


def _view(rid: str, lora: str | None) -> RequestView:
    return RequestView(rid, MODEL, 100, 10, lora=lora)


@pytest.mark.parametrize("profile", ["least-load", "round-robin", "prefix-aware", "llm-d", "gimbal"])
def test_every_profile_sends_adapter_requests_to_engines_with_the_adapter(profile: str) -> None:
    fleet = _lora_fleet()
    router = Router(fleet, load_pipeline(PROFILES / f"{profile}.yaml"))
    seen: Counter[str] = Counter()
    base: Counter[str] = Counter()
    for lora, counts in ((None, base), ("a1", seen)):
        for i in range(40):
            record = router.choose(_view(f"{lora}-{i}", lora), now=0.0)
            assert record is not None
            counts[record.engine_id] += 1
            fleet.reserve(record.engine_id, f"{lora}-{i}", RunningEntry(100, 10, 0.1, 0.0))
    assert set(seen) == {"m-1", "m-3"}, seen
    assert len(base) == 4, base  # base-model requests use the whole fleet
    # a retry never lands on an engine without the adapter: with both holders excluded, none
    assert router.choose(_view("x", "a1"), exclude=("m-1", "m-3"), now=0.0) is None
    record = router.choose(_view("y", "a1"), exclude=("m-1",), now=0.0)
    assert record is not None and record.engine_id == "m-3"
    # no engine has it: any engine (the engine decides; an on-demand loader serves it)
    assert router.choose(_view("z", "a9"), now=0.0) is not None
    # its holders out of rotation (a connect failure ejects one, a drain, a stall): no engine, not
    # one without it (a 404 "does not exist" a client takes as final); the request waits or is a 503
    fleet.record_health("m-1", False, 1, 1)
    fleet.set_draining("m-3", True)
    assert router.choose(_view("w", "a1"), now=0.0) is None
    assert router.choose(_view("w2", "a1"), exclude=("m-0",), now=0.0) is None


def test_a_load_on_demand_profile_prefers_but_does_not_require_the_adapter() -> None:
    fleet = _lora_fleet()
    profile = {
        "filters": [{"name": "lora_affinity", "params": {"load_on_demand": True}}],
        "scorers": [{"name": "lora_affinity", "weight": 2.0}, {"name": "least_load"}],
        "picker": {"name": "max_score_random"},
    }
    router = Router(fleet, compile_profile(profile))
    assert not router.lora.required
    record = router.choose(_view("r", "a1"), now=0.0)
    assert record is not None and record.engine_id in ("m-1", "m-3")
    record = router.choose(_view("x", "a1"), exclude=("m-1", "m-3"), now=0.0)
    assert record is not None and record.engine_id in ("m-0", "m-2")  # it would load the adapter


async def test_hyperflexis_placements_of_adapter_requests_go_to_engines_with_the_adapter() -> None:
    fleet = offline_fleet({MODEL: 2})
    fleet.set_adapters("m-1", frozenset({"a1"}))
    core = DispatchCore(
        fleet,
        Router(fleet, load_pipeline(PROFILES / "hyperflexis.yaml")),
        make_order("slo_tpot", {}),
        lambda _: (DEFAULT_PREFILL, DEFAULT_DECODE),
        lambda _: ClassLimits(),
        hyperflexis=HyperFlexisParams(),
        tightest_ttft_s=math.inf,
    )
    loop = DispatchLoop(core)
    loop.start()
    try:
        placed: Counter[str] = Counter()
        for i in range(12):
            lora = "a1" if i % 2 else None
            entry = RunningEntry(100, 10, 0.1, 0.0)
            record = await loop.place(_view(f"r{i}", lora), 5.0, 0.1, "c", entry)
            if lora is not None:
                placed[record.engine_id] += 1
            assert set(fleet.records[record.engine_id].running) == {f"r{i}"}  # one reservation
            loop.release(record.engine_id, f"r{i}")
        assert placed == {"m-1": 6}
        assert all(not r.running and r.in_flight == 0 for r in fleet.records.values())
    finally:
        await loop.stop()


def test_adapter_prompts_are_rooted_apart_in_the_prefix_index() -> None:
    tokens = np.arange(64, dtype=np.uint64)
    base, adapter = prompt_blocks(MODEL, tokens), prompt_blocks(MODEL, tokens, None, "a1")
    assert base is not None and adapter is not None
    assert adapter.root == root_key(MODEL, "a1") != base.root == root_key(MODEL)
    assert adapter.hashes(16)[0] != base.hashes(16)[0]
    salted = prompt_blocks(MODEL, tokens, "t", "a1")
    assert salted is not None and salted.root == root_key(MODEL, "a1", "t")


# -- end to end ---------------------------------------------------------------------------------------

_n = itertools.count()


def chat(
    gw: RunningGateway, model: str, *, debug: bool = False, content: str | None = None
) -> httpx.Response:
    # a prompt of its own per request, so no profile sticks to an engine by prefix
    text = content if content is not None else f"{next(_n)} tell me something"
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    headers = {"x-slogate-debug": "1"} if debug else {}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def served_by(gw: RunningGateway, model: str, n: int) -> Counter[str]:
    engines: Counter[str] = Counter()
    for _ in range(n):
        r = chat(gw, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model  # the engine was sent the name the client used
        engines[r.headers["x-slogate-engine"]] += 1
    return engines


@pytest.fixture(scope="module")
def lora_pair() -> Iterator[list[ChildProcess]]:
    """e0 has adapter a1 loaded from the start; e1 has none."""
    with (
        spawn_sim_engine(*SIM_ARGS, "--lora-modules", "a1=/adapters/a1", name="e0") as e0,
        spawn_sim_engine(*SIM_ARGS, name="e1") as e1,
    ):
        yield [e0, e1]


def test_adapter_requests_go_to_the_engine_that_has_it(lora_pair: list[ChildProcess]) -> None:
    engines = [engine_entry(e) for e in lora_pair]
    with run_gateway(engines=engines, monitor_interval_s=0.2) as gw:
        assert served_by(gw, "a1", 8) == {"e0": 8}
        assert set(served_by(gw, MODEL, 8)) == {"e0", "e1"}
        r = chat(gw, "nope")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["type"] == "not_found_error" and error["code"] == "model_not_found"
        assert error["param"] == "model" and "'nope'" in error["message"]
        listed = httpx.get(gw.url + "/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(MODEL, None), ("a1", MODEL)]
        shown = {e["id"]: e["adapters"] for e in httpx.get(gw.url + "/admin/engines").json()["engines"]}
        assert shown == {"e0": ["a1"], "e1": []}
        # streamed too
        body = {
            "model": "a1",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        }
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as stream:
            assert stream.status_code == 200 and stream.headers["x-slogate-engine"] == "e0"
            assert '"model":"a1"' in stream.read().decode()


def test_hyperflexis_serves_adapter_requests_on_the_engine_that_has_it(lora_pair: list[ChildProcess]) -> None:
    engines = [engine_entry(e) for e in lora_pair]
    with run_gateway(engines=engines, monitor_interval_s=0.2, routing_profile="hyperflexis") as gw:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: chat(gw, "a1"), range(12)))
        assert [r.status_code for r in answers] == [200] * 12
        assert Counter(r.headers["x-slogate-engine"] for r in answers) == {"e0": 12}
        assert chat(gw, MODEL).status_code == 200 and chat(gw, "nope").status_code == 404


def test_prefix_aware_keys_adapter_prompts_apart(lora_pair: list[ChildProcess]) -> None:
    engines = [engine_entry(e) for e in lora_pair]
    prompt = "a long shared instruction for every turn of this test " * 30
    with run_gateway(engines=engines, monitor_interval_s=0.2, routing_profile="prefix-aware") as gw:

        def cached(model: str) -> tuple[str, int]:
            r = chat(gw, model, debug=True, content=prompt)
            assert r.status_code == 200, r.text
            decision = r.headers["x-slogate-decision"]
            found = re.search(r"cached_tokens=(\d+)/(\d+)", decision)
            assert found is not None, decision
            return r.headers["x-slogate-engine"], int(found.group(1))

        assert cached("a1") == ("e0", 0)
        # the same prompt to the base model holds nothing of the adapter's blocks
        assert cached(MODEL)[1] == 0
        engine, hit = cached("a1")
        assert engine == "e0" and hit > 0  # the adapter's own blocks, where it went


def test_an_adapter_loaded_at_runtime_is_used_after_the_next_scrape() -> None:
    with (
        spawn_sim_engine(*SIM_ARGS, "--lora-modules", "a1=/adapters/a1", name="e0") as e0,
        spawn_sim_engine(*SIM_ARGS, name="e1") as e1,
        run_gateway(engines=[engine_entry(e0), engine_entry(e1)], monitor_interval_s=0.2) as gw,
    ):
        fleet = gw.gateway.fleet
        assert fleet is not None
        assert served_by(gw, "a1", 4) == {"e0": 4}
        r = httpx.post(
            e1.url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "/adapters/a1"}
        )
        assert r.status_code == 200, r.text
        assert wait_until(lambda: "a1" in fleet.records["e1"].adapters, timeout=5)
        assert set(served_by(gw, "a1", 8)) == {"e0", "e1"}
        # unloaded from e0: only e1 takes it; unloaded everywhere: an unknown model again
        r = httpx.post(e0.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status_code == 200, r.text
        assert wait_until(lambda: "a1" not in fleet.records["e0"].adapters, timeout=5)
        assert served_by(gw, "a1", 4) == {"e1": 4}
        httpx.post(e1.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}).raise_for_status()
        assert wait_until(lambda: fleet.adapter_base("a1") is None, timeout=5)
        assert chat(gw, "a1").status_code == 404


def test_an_adapter_unloaded_between_reads_is_retried_on_an_engine_that_has_it() -> None:
    # both engines have a1 when the gateway last read their model lists; e0 drops it before the
    # next read (30 s away): a request sent there gets the engine's 404, and goes to e1 instead
    with (
        spawn_sim_engine(*SIM_ARGS, "--lora-modules", "a1=/adapters/a1", name="e0") as e0,
        spawn_sim_engine(*SIM_ARGS, "--lora-modules", "a1=/adapters/a1", name="e1") as e1,
        run_gateway(
            engines=[engine_entry(e0), engine_entry(e1)],
            monitor_interval_s=30.0,
            routing_profile="round-robin",
        ) as gw,
    ):
        fleet = gw.gateway.fleet
        assert fleet is not None
        assert wait_until(lambda: all("a1" in r.adapters for r in fleet.records.values()), timeout=5)
        httpx.post(e0.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}).raise_for_status()
        assert served_by(gw, "a1", 4) == {"e1": 4}
        assert "a1" not in fleet.records["e0"].adapters and "a1" in fleet.records["e1"].adapters
        text = httpx.get(gw.url + "/metrics").text
        assert 'slogate_upstream_retries_total{reason="adapter_gone"} 1.0' in text


def test_an_adapter_whose_engines_are_all_out_of_rotation_is_a_503_not_a_404() -> None:
    """Its only engine ejected, the adapter is still listed (its adapters are kept for when it
    comes back), and its requests went to an engine without it: a 404 "does not exist", which
    clients take as final. It is a 503 with Retry-After, as for a base model with no engine."""
    with (
        spawn_sim_engine(*SIM_ARGS, "--lora-modules", "gone=/adapters/gone", name="holder") as holder,
        spawn_sim_engine(*SIM_ARGS, name="plain") as plain,
    ):
        engines = [engine_entry(holder), engine_entry(plain)]
        with run_gateway(engines=engines, monitor_interval_s=0.2, eject_after_failures=1) as gw:
            assert served_by(gw, "gone", 2) == {"holder": 2}
            holder.stop()

            def ejected() -> bool:
                listed = httpx.get(gw.url + "/admin/engines").json()["engines"]
                return any(e["id"] == "holder" and not e["healthy"] for e in listed)

            assert wait_until(ejected, timeout=10)
            refusals = metrics.REGISTRY.get_sample_value("slogate_no_engine_total", {"model": MODEL}) or 0.0
            r = chat(gw, "gone")
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "no_healthy_engine"
            # counted under the base model, as any refusal of it (it was a "-" series of its own);
            # (counted once the answer went out, in the gateway's thread)
            assert wait_until(
                lambda: (
                    metrics.REGISTRY.get_sample_value("slogate_no_engine_total", {"model": MODEL})
                    == refusals + 1
                )
            )
            assert served_by(gw, MODEL, 2) == {"plain": 2}  # the base model is served all the same


@pytest.mark.parametrize("profile", ["round-robin", "least-load"])
def test_one_model_s_requests_do_not_move_another_model_s_ties(profile: str) -> None:
    """The rotation among equally good engines was one counter for every model: a client
    alternating two models (or calling a one-engine model between calls) advanced it by two each
    round, and each model's requests all went to the same one of its two engines."""
    fleet = offline_fleet({"a": 2, "b": 2})
    router = Router(fleet, load_pipeline(PROFILES / f"{profile}.yaml"))
    placed: Counter[str] = Counter()
    for i in range(40):
        for model in ("a", "b"):
            record = router.choose(RequestView(f"{model}{i}", model, 100, 10), now=0.0)
            assert record is not None
            placed[record.engine_id] += 1  # (nothing reserved: every pick is a tie of idle engines)
    assert placed == {"a-0": 20, "a-1": 20, "b-0": 20, "b-1": 20}, placed


def test_a_request_brought_within_the_look_ahead_by_a_cancel_is_placed_at_once() -> None:
    """The pipeline looks PIPELINE_LOOKAHEAD requests past a head blocked on its adapter's engine;
    one that a cancel (or an expiry) brought within that was left for the model's next engine
    event, while an engine that could take it stood idle."""
    from gateway.dispatch.core import PIPELINE_LOOKAHEAD, Ticket
    from gateway.dispatch.offline import offline_core
    from policies.queue_order import QueuedRequest

    fleet = offline_fleet({MODEL: 2})
    fleet.set_adapters("m-0", frozenset({"a1"}))
    core = offline_core(fleet, max_engine_load=1)
    woken: list[bool] = []
    core.wake = lambda: woken.append(True)  # type: ignore[method-assign]

    def submit(rid: str, lora: str | None, seq: int) -> object:
        view = RequestView(rid, MODEL, 100, 10, arrival=0.0, lora=lora)
        item = QueuedRequest(view=view, ttft_slo=1.0, tpot_slo=0.1, seq=seq, queue_deadline=30.0)
        return core.submit(Ticket(item, "c", RunningEntry(100, 10, 0.1, 0.0), 0.0), 0.0)

    assert submit("busy", "a1", 0) is not None  # m-0, the adapter's engine, is full now
    fleet.reserve("m-1", "other", RunningEntry(100, 10, 0.1, 0.0))  # and m-1 for a while
    for i in range(PIPELINE_LOOKAHEAD):
        assert submit(f"a1-{i}", "a1", i + 1) is None  # the head, and 31 more behind it
    assert submit("base", None, 100) is None  # 33rd in the queue: past the 32 the pass reads
    fleet.release("m-1", "other")
    core.step(1.0)
    assert "base" in core.tickets  # (still past the look-ahead: m-1 stays idle)
    core.cancel("a1-5", 2.0)
    core.step(2.0)
    assert [rid for rid, _ in core.outbox] == ["base"] and "base" not in core.tickets
