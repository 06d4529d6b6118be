"""Shared helpers for real-engine provisioning: cache location, progress lines, logged commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

CACHE_ENV = "SLOGATE_CACHE_DIR"


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


def progress(message: str) -> None:
    """One progress line on stderr (provisioning is slow; the user should see what it is doing)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[slogate real-engines {stamp}] {message}", file=sys.stderr, flush=True)


def run_logged(
    cmd: Sequence[str | os.PathLike[str]],
    log_path: Path,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    what: str = "",
) -> None:
    """Run ``cmd`` with stdout/stderr appended to ``log_path``; raise ProvisionError on failure."""
    args = [os.fspath(c) for c in cmd]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    with log_path.open("ab") as log:
        log.write(f"\n$ {' '.join(args)}\n".encode())
        log.flush()
        proc = subprocess.run(args, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = tail_text(log_path, 30)
        raise ProvisionError(
            f"{what or args[0]} failed with exit code {proc.returncode}; see {log_path}\n{tail}"
        )


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
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
