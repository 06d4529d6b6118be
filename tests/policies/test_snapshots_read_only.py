"""Policies read engine snapshots and never change them.

:class:`~policies.api.EngineSnapshot` is a plain (not frozen) dataclass: the fleet rebuilds an
engine's entry on every reservation, release, first token and scrape, and a frozen one cost 2.3x as
much to make (the saturated dispatch loop's largest single cost at 256 engines). The fleet hands
the same entries to every placement, so a policy that wrote to one would corrupt every later
decision; this test holds every shipped routing profile to reading only.
"""

from __future__ import annotations

import copy
import random

import pytest

from gateway.router import load_pipeline
from policies.api import EngineSnapshot, EngineState, RequestView, Role
from profiles import PROFILES_DIR

PROFILES = sorted((PROFILES_DIR / "routing").glob("*.yaml"))


def _fleet(rng: random.Random) -> list[EngineSnapshot]:
    engines = []
    for i in range(6):
        state = EngineState(
            num_running=rng.randint(0, 8),
            num_waiting=rng.randint(0, 4),
            kv_usage=rng.random(),
            prefix_queries=1000.0,
            prefix_hits=rng.random() * 1000,
            block_size=16,
            num_gpu_blocks=1000,
        )
        engines.append(
            EngineSnapshot(
                engine_id=f"e{i}",
                model="m",
                role=Role.COLLOCATED,
                stale=i == 5,
                in_flight=rng.randint(0, 8),
                in_flight_tokens=rng.randint(0, 4000),
                in_flight_at_scrape=rng.randint(0, 8),
                state=None if i == 4 else state,
                accepts_priority=i % 2 == 0,
                running_tokens=rng.randint(0, 4000),
                adapters=frozenset({"lora-a"}) if i == 3 else frozenset(),
            )
        )
    return engines


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_no_shipped_routing_profile_writes_to_the_snapshots_it_reads(path) -> None:
    pipeline = load_pipeline(path)
    rng = random.Random(path.stem)
    engines = _fleet(rng)
    before = [copy.copy(e) for e in engines]
    loads = [e.load for e in engines]
    state = pipeline.picker.initial_state()
    for n in range(20):
        request = RequestView(
            request_id=f"r{n}",
            model="m",
            prompt_tokens=rng.randint(1, 4000),
            max_output_tokens=rng.randint(1, 500),
            arrival=float(n),
            priority=rng.randint(0, 3),
            lora="lora-a" if n % 5 == 0 else None,
        )
        _, state = pipeline.choose(request, engines, state, float(n))
    assert engines == before
    assert [e.load for e in engines] == loads
