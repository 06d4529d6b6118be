"""Fixtures for the real-engine tier: real vLLM (CPU build) and llama.cpp servers on tiny local models.

The tier runs with the rest of the suite (the README's test command and ``.ci/run``). A cold cache
costs about 10 minutes of provisioning on 2 cores (vLLM venv 2-4 min, llama.cpp build 6-9 min) and
~3.6 GB; with warm caches (``~/.cache/slogate`` or ``$SLOGATE_CACHE_DIR``) it takes a few minutes,
most of it vLLM start-up. Provisioning and server start-up report their progress on the terminal
although pytest captures output (see ``_progress_on_terminal``). Skip the tier with
``SLOGATE_REAL_ENGINES=0`` or ``-m "not real_engines"``; run only it with ``pytest tests/realengines``.

Servers are session-scoped and shared by all tests; the two vLLM servers start concurrently.
Both run with ``--max-num-seqs 2`` so that a handful of requests already forms a waiting queue (the
priority and least-load tests need one; the default batch limit would run everything at once), and
both also answer to the shared model name ``tiny-vllm`` so the gateway can balance between them.
The FCFS one also publishes KV events and has vLLM's dev endpoints on, for the prefix-index tests
(``vllm_kv``: it answers to ``tiny-vllm-kv`` as well). A third server for those alone cost a vLLM
start-up, a minute of both cores on a loaded machine, for one test module.
The P/D module adds a prefill and a decode vLLM server with the NIXL and Example KV connectors
(``vllm_pd_pair``, module-scoped: they run only while that module's tests do; nixl is installed
into the vLLM venv on first use, ~70 MB).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.realengines._common import cache_dir, logs_dir
from gateway.realengines.cli import cache_status
from gateway.realengines.progress import progress, progress_to, terminal_sink
from gateway.realengines.servers import (
    RunningEngine,
    calm_busy_threads,
    late_bound_port,
    start_llamacpp,
    start_vllm,
)
from gateway.realengines.vllm_env import ensure_vllm_env

VLLM_FCFS_NAME = "tiny-vllm-fcfs"
VLLM_PRIORITY_NAME = "tiny-vllm-prio"
VLLM_SHARED_NAME = "tiny-vllm"  # both vLLM servers answer to it
VLLM_ARGS = ("--max-num-seqs", "2")
LLAMACPP_NAME = "tiny-llamacpp"
VLLM_KV_NAME = "tiny-vllm-kv"  # a name of the FCFS server, which publishes KV events
VLLM_PD_NAME = "tiny-vllm-pd"  # served by the P/D pair's prefill and decode server

#: the Responses API keeps its answers (for previous_response_id) only with this set
RESPONSES_STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
TIER_TIMEOUT = 2400  # seconds, per test including session-fixture setup

_memory_report: dict[str, dict[str, float]] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "real_engines: starts real vLLM / llama.cpp servers (slow; provisions ~/.cache/slogate)"
    )


def _tier_enabled() -> bool:
    return os.environ.get("SLOGATE_REAL_ENGINES", "1").strip().lower() not in ("0", "false", "no", "off")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    enabled = _tier_enabled()
    skip = pytest.mark.skip(reason="real-engine tier switched off by SLOGATE_REAL_ENGINES=0")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engines)
            # Session fixtures provision (cold: ~15 min) and start servers inside the first test's
            # setup, far beyond the suite's default per-test timeout.
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT))
            if not enabled:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _progress_on_terminal(pytestconfig: pytest.Config) -> Iterator[None]:
    """Provisioning and start-up lines reach the terminal despite output capture: a cold first
    run spends ~10 minutes inside the first test's fixtures and would otherwise look hung."""
    with progress_to(terminal_sink(pytestconfig)):
        missing = [label for label, ready, _ in cache_status() if not ready]
        if missing:
            progress(
                f"first run: provisioning {', '.join(missing)} into {cache_dir()} (about 10 min and "
                "3.6 GB when nothing is cached; SLOGATE_REAL_ENGINES=0 skips this tier)"
            )
        yield


def _record(engine: RunningEngine) -> None:
    mem = engine.memory()
    _memory_report[f"{engine.kind}:{engine.name}"] = {
        "peak_rss_mib": round(mem["peak_rss_bytes"] / 2**20, 1),
        "rss_mib": round(mem["rss_bytes"] / 2**20, 1),
        "processes": mem["processes"],
        "ready_seconds": round(engine.ready_seconds or 0.0, 1),
    }
    (logs_dir() / "smoke-engines.json").write_text(json.dumps(_memory_report, indent=1))


@pytest.fixture(scope="session")
def _vllm_kv_port() -> int:
    # (below the ephemeral range: vLLM binds it only once started, while the three servers'
    # own sockets take ephemeral ports)
    return late_bound_port()


@pytest.fixture(scope="session")
def vllm_servers(_vllm_kv_port: int) -> Iterator[dict[str, RunningEngine]]:
    """Two vLLM servers started concurrently: FCFS and ``--scheduling-policy priority`` (the
    pair the gateway balances between); the FCFS one also publishes KV events (``vllm_kv``)."""
    started = time.monotonic()
    servers: dict[str, RunningEngine] = {}
    try:
        # (binds the port: vLLM publishes, the gateway connects; the dev endpoints give the
        # tests /reset_prefix_cache)
        servers["fcfs"] = start_vllm(
            VLLM_FCFS_NAME,
            scheduling_policy="fcfs",
            extra_args=VLLM_ARGS,
            aliases=(VLLM_SHARED_NAME, VLLM_KV_NAME),
            kv_events_endpoint=f"tcp://*:{_vllm_kv_port}",
            env={"VLLM_SERVER_DEV_MODE": "1", **RESPONSES_STORE},
            wait=False,
        )
        servers["priority"] = start_vllm(
            VLLM_PRIORITY_NAME,
            scheduling_policy="priority",
            extra_args=VLLM_ARGS,
            aliases=(VLLM_SHARED_NAME,),
            env=RESPONSES_STORE,
            wait=False,
        )
        progress("waiting for the two vLLM servers to start (about a minute)")
        for engine in servers.values():
            engine.wait_ready()
        progress(f"vLLM servers ready after {time.monotonic() - started:.1f} s")
        yield servers
    finally:
        for engine in servers.values():
            if engine.is_running():
                _record(engine)
            engine.stop()


@pytest.fixture(scope="session")
def vllm_kv(vllm_servers: dict[str, RunningEngine], _vllm_kv_port: int) -> tuple[RunningEngine, int]:
    """vLLM publishing KV events on a port it binds (``tcp://*:P``), with the dev endpoints
    (``/reset_prefix_cache``) on: the server and the port."""
    return vllm_servers["fcfs"], _vllm_kv_port


@pytest.fixture(scope="session")
def vllm_fcfs(vllm_servers: dict[str, RunningEngine]) -> RunningEngine:
    return vllm_servers["fcfs"]


@pytest.fixture(scope="session")
def vllm_priority(vllm_servers: dict[str, RunningEngine]) -> RunningEngine:
    return vllm_servers["priority"]


def pd_connector_args(storage: Path) -> tuple[str, ...]:
    """Both KV connectors that work on CPU, in one vLLM MultiConnector (the first connector that has a
    request's KV loads it), so that one prefill/decode pair serves both gateway handovers:

    * NixlConnector: a prefill sent with ``kv_transfer_params.do_remote_decode`` keeps its KV and
      answers the params a decode needs to pull it over UCX (TCP on loopback here).
    * ExampleConnector on a shared directory: every server saves the full 128-token blocks of the
      prompts it computes there (one folder per prompt prefix) and loads them from there for a
      prompt whose folder exists; a request without params finds its KV that way.
    """
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
            ]
        },
    }
    return ("--kv-transfer-config", json.dumps(config))


def nixl_env() -> dict[str, str]:
    """NIXL on CPU: the side channel (handshake) on loopback at a port of its own per server, UCX
    over TCP, shared memory and self on the loopback device."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(late_bound_port()),
        "UCX_TLS": "tcp,self,sm",
        "UCX_NET_DEVICES": "lo",
    }


@contextlib.contextmanager
def calming(engines: Iterable[RunningEngine]) -> Iterator[set[int]]:
    """While the block runs, a thread keeps giving nice 19 to the engines' busy side threads
    (:func:`calm_busy_threads`: NIXL's pollers, which appear during start-up), and
    once more at the end; yields the ids of the threads calmed so far."""
    engines = list(engines)
    calmed: set[int] = set()
    stop = threading.Event()

    def calm() -> None:
        calmed.update(calm_busy_threads(engines))

    def loop() -> None:
        while not stop.is_set():
            calm()

    watcher = threading.Thread(target=loop, name="calm-pollers", daemon=True)
    watcher.start()
    try:
        yield calmed
    finally:
        stop.set()
        watcher.join()
    calm()


@dataclass(frozen=True)
class PdPair:
    prefill: RunningEngine
    decode: RunningEngine
    storage: Path  # the ExampleConnector's shared directory


@pytest.fixture(scope="module")
def vllm_pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """A prefill and a decode vLLM server started concurrently, both with the NIXL and the Example
    connector (``pd_connector_args``). Module-scoped: they run only while the P/D tests do."""
    ensure_vllm_env(nixl=True)  # cached: a marker check when warm
    storage = tmp_path_factory.mktemp("kv-store")
    args = (*VLLM_ARGS, *pd_connector_args(storage))
    started = time.monotonic()
    servers: dict[str, RunningEngine] = {}
    try:
        for role in ("prefill", "decode"):
            # a name each (log and cache root follow it); both answer to VLLM_PD_NAME
            name = f"{VLLM_PD_NAME}-{role}"
            servers[role] = start_vllm(
                name, extra_args=args, env=nixl_env(), aliases=(VLLM_PD_NAME,), wait=False
            )
        progress("waiting for the P/D vLLM servers (prefill, decode; NIXL and Example connectors) to start")
        with calming(servers.values()) as calmed:
            for engine in servers.values():
                engine.wait_ready()
        progress(
            f"P/D vLLM servers ready after {time.monotonic() - started:.1f} s "
            f"({len(calmed)} busy-polling NIXL threads set to nice 19)"
        )
        yield PdPair(servers["prefill"], servers["decode"], storage)
    finally:
        for engine in servers.values():
            if engine.is_running():
                _record(engine)
        with ThreadPoolExecutor(len(servers) or 1) as pool:  # both stop at once
            list(pool.map(RunningEngine.stop, servers.values()))


@pytest.fixture(scope="session")
def llamacpp_server() -> Iterator[RunningEngine]:
    # 2 slots x 4096 tokens (the GGUF's trained context): the tiny model decodes ~1,250 tokens/s, so a
    # request needs thousands of tokens to still be running when a test looks at it
    engine = start_llamacpp(LLAMACPP_NAME, ctx_size=8192)
    try:
        yield engine
    finally:
        if engine.is_running():
            _record(engine)
        engine.stop()


@pytest.fixture(scope="session", params=["vllm", "vllm-priority", "llamacpp"])
def any_engine(request: pytest.FixtureRequest) -> RunningEngine:
    """Each of the three servers in turn (tests using it run once per engine)."""
    name = {"vllm": "vllm_fcfs", "vllm-priority": "vllm_priority", "llamacpp": "llamacpp_server"}
    engine: RunningEngine = request.getfixturevalue(name[request.param])
    return engine
