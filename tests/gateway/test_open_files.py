"""A gateway out of file descriptors is the gateway's shortage, not its engines'. Each stream holds
two sockets; past the process's limit every new upstream connection failed with EMFILE, which the
data path took for an unreachable engine: it ejected every engine, and a burst became an outage
(503 for everything until the health checks readmitted them)."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

from gateway.open_files import raise_open_files_limit
from gateway.procs import spawn_listening, spawn_sim_engine
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry

#: descriptors the gateway may hold: its own start-up takes a few dozen, the rest are streams
LIMIT = 110


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _burst(url: str, streams: int) -> list[int | str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}

    async def one(session: aiohttp.ClientSession) -> int | str:
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                await response.read()
                return response.status
        except aiohttp.ClientError as exc:  # (the gateway may not even accept the connection)
            return type(exc).__name__

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session) for _ in range(streams))))


def test_running_out_of_descriptors_ejects_no_engine() -> None:
    with spawn_sim_engine(*SIM_ARGS, name="e0") as e0, spawn_sim_engine(*SIM_ARGS, name="e1") as e1:
        env = {
            "SLOGATE_ENGINES": json.dumps([engine_entry(e0), engine_entry(e1)]),
            "SLOGATE_PORT": "0",
            "SLOGATE_LOG_LEVEL": "warning",
        }
        # soft and hard limit alike: the gateway cannot raise it past this
        command = ["prlimit", f"--nofile={LIMIT}:{LIMIT}", sys.executable, "-m", "gateway.cli", "serve"]
        with spawn_listening(command, "gateway", env=env) as gateway:
            outcomes = asyncio.run(_burst(gateway.url, 160))

            async def metrics() -> str:
                # the burst's sockets close as it ends: on a slow machine the first connection
                # after it may still find no descriptor (reset at accept), so try for a while
                for _ in range(50):
                    try:
                        async with (
                            aiohttp.ClientSession() as session,
                            session.get(gateway.url + "/metrics") as r,
                        ):
                            return await r.text()
                    except aiohttp.ClientError:  # (reset, or accepted and closed at once)
                        await asyncio.sleep(0.1)
                raise AssertionError("the gateway did not accept a connection 5 s after the burst")

            text = asyncio.run(metrics())
            # the burst did run out: streams were refused for want of a socket (accepted client
            # connections take the descriptors first, so few of the burst get an engine at all)
            refused = [o for o in outcomes if o != 200]
            assert refused, "the limit was never reached: nothing was tested"
            # ... and no engine paid for it: none ejected, no connection failure charged to one
            assert _metric(text, "slogate_engine_healthy") == 2.0
            assert _metric(text, "slogate_upstream_errors_total", kind="connect") == 0.0
            # refused as the gateway's own overload (503), or not even accepted: never a 502
            assert all(o == 503 or isinstance(o, str) for o in refused), sorted(map(str, refused))
            # the next request is served at once: both engines are still in rotation
            assert asyncio.run(_burst(gateway.url, 2)) == [200, 200]


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_HEALTH_WITHOUT_SOCKETS = """
import asyncio, json, resource, socket, sys
import aiohttp
from gateway.engines import adapter_for
from gateway.settings import load_settings

async def main() -> None:
    live, dead = sys.argv[1], sys.argv[2]
    engines = [{"url": url, "kind": "sim", "model": "m", "name": f"e{i}"} for i, url in enumerate((live, dead))]
    settings = load_settings(None, engines=engines)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        live_adapter, dead_adapter = (adapter_for(e, session, 2.0) for e in settings.engines)
        results = {"live": await live_adapter.health(), "dead": await dead_adapter.health()}
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        held = []
        try:
            while True:
                held.append(socket.socket())
        except OSError:
            pass
        results["live, no socket"] = await live_adapter.health()
        results["dead, no socket"] = await dead_adapter.health()
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(json.dumps(results))

asyncio.run(main())
"""


def test_a_health_check_without_a_socket_gives_no_verdict() -> None:
    """The monitor's checks open sockets too: out of descriptors, a check says nothing about the
    engine (None), so consecutive ones cannot eject it; a refused connection is still a failure."""
    import subprocess

    from tests.gateway.conftest import free_port

    with spawn_sim_engine(*SIM_ARGS, name="e0") as live:
        dead = f"http://127.0.0.1:{free_port()}"
        out = subprocess.run(
            [sys.executable, "-c", _HEALTH_WITHOUT_SOCKETS, live.url, dead],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results == {"live": True, "dead": False, "live, no socket": None, "dead, no socket": None}
