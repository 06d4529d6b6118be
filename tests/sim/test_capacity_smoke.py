"""A short run of loadtest/sim_capacity.py so the measurement script cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sim_capacity_smoke() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.sim_capacity",
            "--levels",
            "4,8",
            "--tokens",
            "10",
            "--zero-streams",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "us/token" in out.stdout and "concurrent streams under one core" in out.stdout
    assert out.stdout.count(" streams: ") == 2  # one progress line per level
