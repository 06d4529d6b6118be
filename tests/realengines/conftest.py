"""Fixtures for the real-engine tier: real vLLM (CPU build) and llama.cpp servers on tiny local models.

The tier is opt-in because a cold cache costs ~15 minutes (vLLM venv ~4 min, llama.cpp build ~9 min);
with warm caches (``~/.cache/slogate`` or ``$SLOGATE_CACHE_DIR``) it takes a couple of minutes, most of
it vLLM start-up. Run it with either of::

    pytest -m real_engines tests/realengines
    SLOGATE_REAL_ENGINES=1 pytest tests/realengines

Servers are session-scoped and shared by all tests; the two vLLM servers start concurrently.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.realengines._common import logs_dir
from gateway.realengines.servers import RunningEngine, start_llamacpp, start_vllm

VLLM_FCFS_NAME = "tiny-vllm"
VLLM_PRIORITY_NAME = "tiny-vllm-prio"
LLAMACPP_NAME = "tiny-llamacpp"

TIER_TIMEOUT = 2400  # seconds, per test including session-fixture setup

_memory_report: dict[str, dict[str, float]] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "real_engines: starts real vLLM / llama.cpp servers (slow; provisions ~/.cache/slogate)"
    )


def _tier_enabled(config: pytest.Config) -> bool:
    if os.environ.get("SLOGATE_REAL_ENGINES", "") not in ("", "0"):
        return True
    expr = str(config.getoption("markexpr", "") or "")
    return "real_engines" in expr and "not real_engines" not in expr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    enabled = _tier_enabled(config)
    skip = pytest.mark.skip(
        reason="real-engine tier is opt-in: use -m real_engines or SLOGATE_REAL_ENGINES=1"
    )
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engines)
            # Session fixtures provision (cold: ~15 min) and start servers inside the first test's
            # setup, far beyond the suite's default per-test timeout.
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT))
            if not enabled:
                item.add_marker(skip)


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
def vllm_servers() -> Iterator[dict[str, RunningEngine]]:
    """Two vLLM servers started concurrently: FCFS and ``--scheduling-policy priority``."""
    started = time.monotonic()
    fcfs = start_vllm(VLLM_FCFS_NAME, wait=False)
    servers = {"fcfs": fcfs}
    try:
        servers["priority"] = start_vllm(VLLM_PRIORITY_NAME, scheduling_policy="priority", wait=False)
        for engine in servers.values():
            engine.wait_ready()
        print(f"\nvLLM servers ready after {time.monotonic() - started:.1f} s")
        yield servers
    finally:
        for engine in servers.values():
            if engine.is_running():
                _record(engine)
            engine.stop()


@pytest.fixture(scope="session")
def vllm_fcfs(vllm_servers: dict[str, RunningEngine]) -> RunningEngine:
    return vllm_servers["fcfs"]


@pytest.fixture(scope="session")
def vllm_priority(vllm_servers: dict[str, RunningEngine]) -> RunningEngine:
    return vllm_servers["priority"]


@pytest.fixture(scope="session")
def llamacpp_server() -> Iterator[RunningEngine]:
    engine = start_llamacpp(LLAMACPP_NAME)
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
