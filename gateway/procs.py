"""Child processes the CLI starts (simulated engines, a gateway for benchmarks), never orphaned.

Children get ``PR_SET_PDEATHSIG`` so the kernel sends them SIGTERM if this process dies without
cleaning up (even on SIGKILL), and :meth:`ChildProcess.stop` terminates, waits, then kills.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LISTENING = re.compile(r"listening on (http://\S+)")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: stop() still cleans up on a normal exit
        pass


@dataclass
class ChildProcess:
    proc: subprocess.Popen[str]
    url: str
    name: str
    log_path: Path | None = None
    output: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 5.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_listening(
    argv: Sequence[str],
    name: str,
    *,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 30.0,
    log_path: Path | None = None,
) -> ChildProcess:
    """Start ``argv`` and wait for the line ``... listening on http://HOST:PORT`` on its stdout.

    Standard error goes to ``log_path`` (or is inherited). Raises RuntimeError with the child's
    output if it exits or stays silent past the timeout.
    """
    stderr = open(log_path, "ab") if log_path else None  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=_die_with_parent,
    )
    if stderr is not None:
        stderr.close()
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if line:
                seen.append(line.rstrip())
                match = _LISTENING.search(line)
                if match:
                    return ChildProcess(proc, match.group(1), name, log_path, seen)
                continue
        if proc.poll() is not None:
            break
    child = ChildProcess(proc, "", name, log_path, seen)
    child.stop(1.0)
    raise RuntimeError(f"{name} did not start (exit {proc.returncode}); output: {' | '.join(seen[-10:])}")


def spawn_sim_engine(
    *args: str, name: str = "sim-engine", env: dict[str, str] | None = None, log_path: Path | None = None
) -> ChildProcess:
    """One simulated engine on a free port: ``slogate sim-engine --port 0 ARGS``."""
    return spawn_listening(
        [sys.executable, "-m", "gateway.sim.cli", "--port", "0", *args], name, env=env, log_path=log_path
    )
