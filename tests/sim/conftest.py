"""Fixtures: simulated engines as real child processes on runtime ports (stopped by the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sim.helpers import MODEL, write_profile
from tests.support.sim_process import SimProcess, start_sim_engine

ZERO_LAT = {k: 0.0 for k in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c")}


@pytest.fixture(scope="session")
def profiles_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def timing_profile(profiles_dir: Path) -> Path:
    """TTFT 300 ms, ITL 40 ms at time scale 1, independent of lengths: easy to check over HTTP."""
    return write_profile(
        profiles_dir / "timing.yaml", latency={**ZERO_LAT, "prefill_a": 0.3, "decode_a": 0.04}
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[SimProcess]:
    """A general-purpose qwen-7b engine, 10x faster than real time."""
    with start_sim_engine("--profile", "qwen-7b", "--model", MODEL, "--time-scale", "10") as proc:
        yield proc
