"""What the live replay sends is what the offline simulator assumes a client sends."""

from __future__ import annotations

import pytest
from aiohttp import web

from gateway.experiments.replay import replay
from gateway.experiments.workload import RequestSpec
from gateway.simulator.calibration import replay_live
from gateway.simulator.scenario import Scenario
from tests.support.local_app import serving


async def test_a_conversation_s_turns_carry_their_session_and_single_requests_none() -> None:
    """The simulator keys a conversation's turns as one session (the affinity scorer's); the
    live replay sent no session id, so a calibration of an affinity profile compared a run that
    kept sessions together with one that could not."""
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("x-session-id"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    specs = [
        RequestSpec(0.0, "chat", 0, 20, 1, 5.0, 0.5, session="conv-1", turn=0),
        RequestSpec(0.01, "chat", 0, 20, 1, 5.0, 0.5, session="conv-1", turn=1),
        RequestSpec(0.02, "chat", 0, 20, 1, 5.0, 0.5),
    ]
    async with serving(app) as port:
        outcomes = await replay(f"http://127.0.0.1:{port}", "m", specs, 1.0, progress=False)
    assert [o.status for o in outcomes] == [200, 200, 200]
    assert sorted(seen, key=str) == sorted(["conv-1", "conv-1", None], key=str)


def test_a_live_replay_refuses_a_monitor_interval_it_does_not_run() -> None:
    scenario = Scenario(
        "hyperflexis-4task", qps=1, policy="least-load", engines=1, requests=1, monitor_interval_s=0.2
    )
    with pytest.raises(ValueError, match="monitor_interval_s"):
        replay_live(scenario)
