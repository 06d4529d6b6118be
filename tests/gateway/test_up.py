"""``slogate up`` as a user runs it: engines + gateway come up, answer, and all stop on any signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.gateway.conftest import free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().split(") ")[-1][0]  # noqa: SIM115
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_up_serves_and_leaves_no_engine_behind(sig: signal.Signals) -> None:
    """Ctrl-C and SIGTERM stop everything cleanly; even SIGKILL (no cleanup runs) orphans nothing."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "up",
            "--port",
            str(port),
            "--engines",
            "2",
            "--time-scale",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "slogate listening on" in line:
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{port}" in output and "curl -s" in output, output
        model = re.search(r"model '([^']+)'", output)
        assert model, output
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": model.group(1),
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 8,
            },
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        engines = _children(proc.pid)
        assert len(engines) == 2
    finally:
        proc.send_signal(sig)
        code = proc.wait(20)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in engines), "engine processes outlived slogate up"
