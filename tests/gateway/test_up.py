"""``slogate up`` as a user runs it: engines + gateway come up, answer, and all stop on any signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def _up(engines: int, time_scale: str, **popen: Any) -> subprocess.Popen[Any]:
    """``slogate up`` as a user starts it, on a port the system picks (its "listening" line says
    which: :func:`_url`); its output merged into ``popen``'s stdout."""
    argv = [sys.executable, "-m", "gateway.cli", "up", "--port", "0", "--engines", str(engines)]
    return subprocess.Popen([*argv, "--time-scale", time_scale], stderr=subprocess.STDOUT, **popen)


def _until_listening(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    """What ``proc`` printed up to the gateway's "listening" line (or its exit, or the timeout)."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "slogate listening on" in line or not line:
            break
    return "".join(lines)


def _url(output: str) -> str:
    """The gateway's address, from its "listening" line in ``output``."""
    found = re.search(r"slogate listening on (http://127\.0\.0\.1:\d+)", output)
    assert found, output
    return found.group(1)


def _assert_gone(engines: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in engines), "engine processes outlived slogate up"


def _in_a_terminal() -> subprocess.Popen[str]:
    """``slogate up`` with one real-time engine in a process group of its own, as a shell gives
    the job it runs (a terminal's Ctrl-C signals that whole group)."""
    return _up(1, "1", stdout=subprocess.PIPE, text=True, start_new_session=True)


def _model_once_listening(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What ``proc`` printed up to its "listening" line, and the model it serves."""
    assert proc.stdout is not None
    output = ""
    while "slogate listening on" not in output and proc.poll() is None:
        output += proc.stdout.readline()
    model = re.search(r"model '([^']+)'", output)
    assert model, output
    return output, model.group(1)


# (SIGINT: test_ctrl_c_in_a_terminal_drains_the_open_stream_then_stops_everything)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_up_serves_and_leaves_no_engine_behind(sig: signal.Signals) -> None:
    """SIGTERM stops everything cleanly; even SIGKILL (no cleanup runs) orphans nothing."""
    proc = _up(2, "10", stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        output = _until_listening(proc)
        url = _url(output)
        assert "curl -s" in output, output
        model = re.search(r"model '([^']+)'", output)
        assert model, output
        r = httpx.post(
            f"{url}/v1/chat/completions",
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
    _assert_gone(engines)


def test_ctrl_c_in_a_terminal_drains_the_open_stream_then_stops_everything() -> None:
    """A terminal's Ctrl-C signals its whole foreground process group. The engines were in it:
    they got SIGINT with the gateway and froze the stream it was draining (cut two minutes later)."""
    proc = _in_a_terminal()
    engines: list[int] = []
    try:
        output, model = _model_once_listening(proc)
        engines = _children(proc.pid)
        assert engines and all(os.getpgid(e) != os.getpgid(proc.pid) for e in engines)
        body = {"model": model, "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
        events, done = 0, False
        url = f"{_url(output)}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=10) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
                    done = done or line == "data: [DONE]"
        assert done and events == 41 + 1
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _assert_gone(engines)


def test_an_engine_that_dies_is_reported_and_reaped(tmp_path: Path) -> None:
    """An engine killed under `slogate up` stayed a zombie until up exited, with nothing said."""
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = _up(2, "10", stdout=out)

    def logged(text: str, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while text not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        return text in log.read_text()

    try:
        assert logged("slogate listening on", 60), log.read_text()
        engines = _children(proc.pid)
        assert len(engines) == 2, log.read_text()
        os.kill(engines[0], signal.SIGKILL)
        assert logged("exited (code -9); the gateway serves without it", 10), log.read_text()
        deadline = time.monotonic() + 5
        while engines[0] in _children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engines[0] not in _children(proc.pid), "the dead engine was not reaped"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_up_with_no_engines_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "up", "--engines", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "positive integer" in proc.stderr and "Traceback" not in proc.stderr


def test_the_configuration_sets_the_port_when_no_flag_does(tmp_path: Path) -> None:
    """``up`` gave --host and --port defaults that beat the file and SLOGATE_*: a port set there
    was ignored (the gateway came up on 8000), and engines named there were dropped unsaid. The
    variable holding a replaced engine's key is no misspelt setting (up refused to start)."""
    port = free_port()
    config = tmp_path / "up.yaml"
    config.write_text(
        f"port: {port}\nengines:\n"
        "  - {url: 'http://127.0.0.1:9', model: m, api_key_env: SLOGATE_MY_ENGINE_KEY}\n"
    )
    argv = [sys.executable, "-m", "gateway.cli", "up", "--engines", "1", "--time-scale", "10"]
    proc = subprocess.Popen(
        [*argv, "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SLOGATE_MY_ENGINE_KEY": "sk-engine"},
    )
    assert proc.stdout is not None
    try:
        output = _until_listening(proc)
        assert f"slogate listening on http://127.0.0.1:{port}" in output, output
        assert "the engines in the configuration are not used" in output, output
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_the_keys_of_replaced_engines_are_read_from_any_spelling_and_odd_files_do_not_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Settings read SLOGATE_ENGINES in any case, so ``up`` must too; a file it cannot read is
    left to the settings to refuse (exit 2), not a traceback here."""
    from gateway.up import _replaced_engines

    engines = '[{"url": "http://127.0.0.1:9", "model": "m", "api_key_env": "SLOGATE_MY_ENGINE_KEY"}, 5]'
    monkeypatch.setenv("slogate_engines", engines)
    assert _replaced_engines(None) == {"SLOGATE_MY_ENGINE_KEY"}
    assert "not used" in capsys.readouterr().err
    monkeypatch.delenv("slogate_engines")
    odd = tmp_path / "odd.yaml"
    for content in (
        b"engines: [\xe9]\n",
        b"- a list\n",
        b"engines: {a: 1}\n",
        b"engines: [{api_key_env: [1]}]\n",
    ):
        odd.write_bytes(content)
        assert _replaced_engines(odd) == set()


def test_a_second_ctrl_c_ends_the_open_stream_with_an_answer_and_stops_cleanly() -> None:
    """The first Ctrl-C drains (the stream goes on, within the shutdown grace); the second ends
    what is open now: the stream gets an error event that says why and [DONE], the engines stop,
    and the exit is clean. uvicorn's own second Ctrl-C skipped the gateway's shutdown and cut the
    stream without a word."""
    proc = _in_a_terminal()
    assert proc.stdout is not None
    engines: list[int] = []
    try:
        output, model = _model_once_listening(proc)
        engines = _children(proc.pid)
        assert engines  # (else the check that they are gone at the end would check nothing)
        body = {
            "model": model,
            "prompt": "hi",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        lines: list[str] = []
        url = f"{_url(output)}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=10) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line[6:])
                if len(lines) == 2:
                    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: drain
                elif len(lines) == 20:
                    os.killpg(proc.pid, signal.SIGINT)  # and again: end it now
        assert 20 <= len(lines) < 150 and lines[-1] == "[DONE]", lines[-3:]
        assert '"shutting_down"' in lines[-2]
        assert proc.wait(15) == 0
        rest = proc.stdout.read()
        assert "Ctrl-C again ends them now" in rest and "told to stop again: 1 open" in rest, rest
        assert "Traceback" not in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _assert_gone(engines)


def test_a_busy_port_is_one_line() -> None:
    """A port in use printed the "gateway on" banner and then uvicorn's bind error; now up binds
    first and says only that it cannot listen there."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "up", "--port", str(port), "--engines", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stderr
    assert f"slogate up: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "gateway on" not in proc.stdout and "Traceback" not in proc.stderr


def test_port_0_shows_the_port_it_got() -> None:
    proc = _up(1, "10", stdout=subprocess.PIPE, text=True)
    try:
        output = _until_listening(proc)
        got = re.search(r"slogate gateway on http://127\.0\.0\.1:(\d+)", output)
        assert got and got.group(1) != "0", output
        assert f"slogate listening on http://127.0.0.1:{got.group(1)}" in output, output
        assert httpx.get(f"http://127.0.0.1:{got.group(1)}/ready", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_a_configuration_or_profile_in_error_is_one_line_before_any_engine_starts(tmp_path: Path) -> None:
    """A missing file started every engine before it said so; a routing profile naming an
    unknown plugin printed the "gateway on ... try: curl" banner first, then the error."""
    profile = tmp_path / "bad.yaml"
    profile.write_text("scorers:\n  - name: no_such_scorer\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"routing_profile: {profile}\n")
    for path, message in ((tmp_path / "missing.yaml", "invalid configuration"), (config, "invalid profile")):
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "up",
                "--port",
                "0",
                "--engines",
                "2",
                "--config",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert "gateway on" not in proc.stdout and "engine" not in proc.stdout, proc.stdout
        assert time.monotonic() - started < 30
