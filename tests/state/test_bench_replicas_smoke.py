"""A small run of ``slogate bench replicas`` so it cannot rot (the figures come from the CLI): its
structure and sanity, never its targets, on a shared machine and so short a run."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.bench.replica_sessions import SessionTurn, figures, session_figures
from gateway.bench.replicas import Stay, occupancy
from gateway.cli import main
from tests.support.redis_server import redis_server_path


def test_occupancy_counts_engine_time_above_the_limit() -> None:
    stays = [
        Stay("e0", 0.0, 0.0, 2.0),
        Stay("e0", 0.0, 1.0, 3.0),
        Stay("e0", 0.0, 3.0, 4.0),  # (comes as the second leaves: never three at once)
        Stay("e1", 0.0, 0.0, 4.0),
    ]
    peaks, over, means, steps = occupancy(stays, limit=1)
    assert peaks == {"e0": 2, "e1": 1}
    # e0 held two from 1 to 2 s: 1 request-second over the limit, of 5 + 4 request-seconds
    assert over == 1 / 9
    assert means == {"e0": 5 / 4, "e1": 1.0}
    assert steps["e0"][-1] == (4.0, 0)


def test_session_figures_compare_each_turn_with_the_previous_answered_one() -> None:
    turns = [
        SessionTurn(0, 0, "e0", 100, 0),
        SessionTurn(0, 1, "e0", 120, 96),
        SessionTurn(0, 2, "e1", 140, 0),
        SessionTurn(1, 0, "e1", 100, 0),
        SessionTurn(1, 2, "e1", 140, 112),  # (its turn 1 was not answered: not compared)
        SessionTurn(3, 0, "e1", 100, 0),
        SessionTurn(3, 1, "e1", 120, 96),
    ]
    result = figures(turns[:5])
    assert (result.later_turns, result.kept, result.cached) == (2, 0.5, 96 / 260)
    assert figures([]).kept == 0.0
    # even conversations sent a session id, odd ones did not
    both = session_figures(turns, errors=1)
    assert both.with_session == figures(turns[:3]) and both.prompt_only == figures(turns[3:])
    assert (both.answered, both.errors, both.kept) == (7, 1, 0.5)
    assert both.mean_prompt_tokens == sum(t.prompt_tokens for t in turns) / 7


def test_bench_replicas_smoke(tmp_path: Path) -> None:
    redis_server_path()  # (installs it when missing)
    code = main(
        [
            "bench",
            "replicas",
            "--replicas", "2",
            "--engines", "2",
            "--max-engine-load", "2",
            "--tokens", "6",
            "--token-gap-ms", "10",
            "--seconds", "2",
            "--modes", "single,redis",
            "--sessions", "4",
            "--turns", "2",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    bench = json.loads((tmp_path / "points.json").read_text())
    assert [p["mode"] for p in bench["points"]] == ["single", "redis"]
    for point in bench["points"]:
        assert point["requests"] >= 10 and point["errors"] == 0
        assert point["peak"] >= 1 and set(point["peaks"]) == {"engine-0", "engine-1"}
        assert 0 <= point["over_limit_share"] <= 1 and point["ttft_p50_ms"] > 0
    assert bench["points"][1]["store_commands_per_s"] > 0
    for point in bench["points"]:
        sessions = point["sessions"]
        assert sessions["answered"] + sessions["errors"] >= 4 and sessions["mean_prompt_tokens"] > 100
        for group in ("with_session", "prompt_only"):
            assert 0 <= sessions[group]["cached"] <= 1 and 0 <= sessions[group]["kept"] <= 1
    assert (tmp_path / "replicas_sessions.png").stat().st_size > 10_000
    assert (tmp_path / "replicas_occupancy.png").stat().st_size > 10_000
    assert "engine time above max_engine_load" in (tmp_path / "table.md").read_text()
