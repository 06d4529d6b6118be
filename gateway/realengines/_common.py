"""Shared helpers for real-engine provisioning: cache location, logged commands, file locks."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.realengines.progress import heartbeat, last_log_line, progress

CACHE_ENV = "SLOGATE_CACHE_DIR"
POLL_S = 1.0  # how often a long command or a lock wait checks in (heartbeats are rarer)


class ProvisionError(RuntimeError):
    """A provisioning step failed; the message names the log file to read."""


def cache_dir() -> Path:
    """Root of all real-engine caches: ``$SLOGATE_CACHE_DIR`` or ``~/.cache/slogate``."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "slogate"
    root.mkdir(parents=True, exist_ok=True)
    return root


def logs_dir() -> Path:
    path = cache_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_logged(
    cmd: Sequence[str | os.PathLike[str]],
    log_path: Path,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    what: str = "",
) -> None:
    """Run ``cmd`` with stdout/stderr appended to ``log_path``; raise ProvisionError on failure.

    While it runs, a heartbeat repeats the current step with the log's latest line (a compiler
    or pip can be silent on the terminal for minutes otherwise)."""
    args = [os.fspath(c) for c in cmd]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    with log_path.open("ab") as log:
        log.write(f"\n$ {' '.join(args)}\n".encode())
        log.flush()
        proc = subprocess.Popen(args, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    code = proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    heartbeat(last_log_line(log_path))
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C, test timeout): do not leave it running
                proc.kill()
                proc.wait()
    if code != 0:
        tail = tail_text(log_path, 30)
        raise ProvisionError(f"{what or args[0]} failed with exit code {code}; see {log_path}\n{tail}")


def tail_text(path: Path, lines: int) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(data[-lines:])


def write_marker(path: Path, content: str) -> None:
    """Write a success marker atomically (so an interrupted run never leaves a half marker)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(content)
    tmp.replace(path)


class FileLock:
    """An exclusive ``flock`` on a file in the cache, so two processes never provision the same thing."""

    def __init__(self, name: str) -> None:
        self.path = cache_dir() / f"{name}.lock"
        self._fd: int | None = None

    def __enter__(self) -> FileLock:
        import fcntl

        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # someone else (another test run, a `slogate real-engine prepare`) is provisioning this
            progress(f"waiting for another process that is provisioning {self.path.stem} ({self.path})")
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    heartbeat()
                    time.sleep(POLL_S)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
