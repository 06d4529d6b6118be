"""Debian packages the tests need, installed with apt-get when missing: once per machine, under a
file lock so parallel test processes do not race (apt's own lock allows one installer), with a
progress line while it runs and at most :data:`INSTALL_TIMEOUT_S` per apt-get run."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gateway.realengines.progress import heartbeat, last_log_line, progress

#: the longest an apt-get run (update, or install) may take; tests that may install give their
#: setup this much beyond pytest's default timeout
INSTALL_TIMEOUT_S = 900

T = TypeVar("T")


class PackageUnavailable(Exception):
    """The packages are missing and could not be installed (the message says why)."""


def _apt(*args: str, log: Path) -> bool:
    """apt-get ``args``, its output to ``log``; a progress line every so often with its last line."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    progress(f"apt-get {' '.join(args)} (log: {log})")
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    with log.open("ab") as out:
        proc = subprocess.Popen(["apt-get", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(proc.args, INSTALL_TIMEOUT_S)
            heartbeat(last_log_line(log))
            time.sleep(1.0)
    return proc.returncode == 0


def installed(packages: tuple[str, ...], found: Callable[[], T | None]) -> T:
    """What ``found`` finds (e.g. the programs' paths), installing ``packages`` first when it finds
    nothing; raises :class:`PackageUnavailable` when they cannot be installed here."""
    what = " ".join(packages)
    result = found()
    if result is not None:
        return result
    if shutil.which("apt-get") is None:
        raise PackageUnavailable(f"{what}: not installed, and this machine has no apt-get")
    if os.geteuid() != 0:
        raise PackageUnavailable(f"{what}: not installed, and apt-get needs root")
    name = "-".join(packages)
    log = Path(tempfile.gettempdir()) / f"slogate-{name}-install.log"
    with (Path(tempfile.gettempdir()) / f"slogate-{name}-install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be installing right now
        result = found()
        if result is not None:
            return result
        try:
            # a fresh machine's package lists may be missing or stale: update once, then retry
            if not _apt("install", "-y", "-q", *packages, log=log):
                _apt("update", "-q", log=log)
                _apt("install", "-y", "-q", *packages, log=log)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PackageUnavailable(f"apt-get install {what} failed: {exc!r}") from None
    result = found()
    if result is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        raise PackageUnavailable(f"apt-get could not install {what}: {' | '.join(tail)}")
    return result
