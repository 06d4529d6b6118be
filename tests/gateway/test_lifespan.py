"""The gateway's lifespan: a start-up that fails half-way leaves nothing open."""

from __future__ import annotations

import asyncio

import pytest

import gateway.app as app_module
from gateway.app import Gateway, build_api
from gateway.settings import load_settings


async def test_a_start_that_fails_half_way_closes_what_it_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifespan stopped the gateway only once its start had returned: a start that raised
    after opening its upstream sessions and monitor tasks left them open (unclosed-session
    warnings, health checks running on in a process that did not serve)."""

    def fails(*_: object, **__: object) -> None:  # (whatever breaks after the sessions are open)
        raise RuntimeError("the dispatch loop could not start")

    started: list[asyncio.Task[None]] = []
    real_start = app_module.FleetMonitor.start

    def start(monitor: app_module.FleetMonitor) -> None:
        real_start(monitor)
        started.extend(monitor._tasks)  # (stop() clears its list: keep the tasks to look at)

    monkeypatch.setattr(app_module.FleetMonitor, "start", start)
    monkeypatch.setattr(app_module, "DispatchLoop", fails)
    gateway = Gateway(load_settings(engines=[{"url": "http://127.0.0.1:9", "kind": "sim", "model": "m"}]))
    api = build_api(gateway)
    with pytest.raises(RuntimeError, match="could not start"):
        async with api.router.lifespan_context(api):
            pass
    sessions = (gateway.session, gateway.fresh_session, gateway.control_session)
    assert all(s is not None and s.closed for s in sessions)
    assert started and all(t.done() for t in started)
