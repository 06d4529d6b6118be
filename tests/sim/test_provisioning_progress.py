"""Real-engine provisioning progress (gateway/realengines/progress.py): steps with elapsed time,
heartbeats while a command or a lock wait runs, and lines that reach the terminal although pytest
captures output. Fake steps only: nothing is provisioned here."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.realengines import _common
from gateway.realengines._common import FileLock, run_logged
from gateway.realengines.progress import ProgressReporter, duration, progress, progress_to

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steps_carry_elapsed_time_and_heartbeats_are_rate_limited() -> None:
    lines: list[str] = []
    clock = FakeClock()
    reporter = ProgressReporter(sink=lines.append, clock=clock, heartbeat_s=30)
    reporter.heartbeat("before any step")  # nothing running yet: nothing to say
    reporter.step("vLLM venv: installing torch")
    clock.now = 10
    reporter.heartbeat("Collecting torch")  # too soon after the last line
    clock.now = 31
    reporter.heartbeat("Downloading torch-2.13.0.whl")
    clock.now = 45
    reporter.heartbeat("ignored")
    clock.now = 100
    reporter.step("llama.cpp: compiling llama-server")
    clock.now = 3700
    reporter.heartbeat("[ 42%] Building CXX object")
    assert len(lines) == 4, lines
    assert all(line.startswith("[slogate real-engines ") for line in lines)
    assert lines[0].endswith(" +0s] [1] vLLM venv: installing torch")
    assert lines[1].endswith(
        " +31s] [1] still vLLM venv: installing torch (31s in this step): Downloading torch-2.13.0.whl"
    )
    assert lines[2].endswith(" +1m40s] [2] llama.cpp: compiling llama-server")
    assert lines[3].endswith(
        " +1h01m] [2] still llama.cpp: compiling llama-server (1h00m in this step): [ 42%] Building CXX object"
    )


def test_duration_format() -> None:
    assert [duration(s) for s in (0, 59.9, 60, 185, 3599, 3600, 7260)] == [
        "0s",
        "59s",
        "1m00s",
        "3m05s",
        "59m59s",
        "1h00m",
        "2h01m",
    ]


def test_a_long_command_reports_its_latest_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "POLL_S", 0.05)
    lines: list[str] = []
    script = "import time; print('[ 37%] Building CXX object ggml.c.o', flush=True); time.sleep(0.6)"
    with progress_to(lines.append, heartbeat_s=0.2):
        progress("llama.cpp: compiling")
        run_logged([sys.executable, "-c", script], tmp_path / "build.log", what="fake build")
    heartbeats = [line for line in lines if "still llama.cpp: compiling" in line]
    assert heartbeats, lines
    assert heartbeats[-1].endswith(": [ 37%] Building CXX object ggml.c.o")


def test_waiting_for_another_provisioner_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_common.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_common, "POLL_S", 0.05)
    lines: list[str] = []
    holder = FileLock("venv-vllm").__enter__()  # another "process": flock locks are per open file
    threading.Timer(0.3, holder.__exit__).start()
    started = time.monotonic()
    with progress_to(lines.append), FileLock("venv-vllm"):
        waited = time.monotonic() - started
    assert waited >= 0.25
    assert len(lines) == 1 and "waiting for another process that is provisioning venv-vllm" in lines[0]


TEST = """
from gateway.realengines.progress import progress

def test_fake_provisioning():
    progress("fake step: building llama-server")
    progress("fake step: tiny GGUF model")
"""


@pytest.mark.parametrize("capture", ["fd", "sys"])
def test_lines_reach_the_terminal_while_pytest_captures(tmp_path: Path, capture: str) -> None:
    # A throwaway test run with the real-engine tier's conftest loaded as a plugin (its autouse
    # fixture installs the terminal sink) and an empty cache, so it also announces a first run.
    # Nothing is provisioned: the fake test only reports steps.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_fake.py").write_text(TEST)

    def run(*extra: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--capture={capture}", *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={
                "PYTHONPATH": str(REPO),
                "PATH": "/usr/bin:/bin",
                "SLOGATE_CACHE_DIR": str(tmp_path / "cache"),
            },
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    shown = run("-p", "tests.realengines.conftest")
    first = (
        "first run: provisioning vllm venv, llama-server, tiny HF model, tiny GGUF model, nixl in vllm venv"
    )
    assert f"] [1] {first}" in shown
    assert "SLOGATE_REAL_ENGINES=0 skips this tier" in shown
    assert "] [2] fake step: building llama-server" in shown
    assert "] [3] fake step: tiny GGUF model" in shown
    # without the tier's sink the same lines vanish into pytest's capture: what the sink fixes
    assert "fake step" not in run()
