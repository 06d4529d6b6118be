"""Child processes the CLI starts (simulated engines, a gateway for benchmarks), never orphaned.

Children get ``PR_SET_PDEATHSIG`` so the kernel sends them SIGTERM if this process dies without
cleaning up (even on SIGKILL), and :meth:`ChildProcess.stop` terminates, waits, then kills.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
_LISTENING = re.compile(r"listening on (http://\S+)")


def die_with_parent(parent: int | None = None) -> None:
    """SIGTERM this process when the thread that started it ends (its parent died): a child
    process of the gateway never outlives it (for subprocess preexec_fn and pool initializers).

    ``parent``: the pid that started it. A parent that died before the signal was asked for is
    gone already and will send nothing: the child then exits at once rather than live on,
    adopted by init."""
    prctl = libc_prctl()
    if prctl is None:  # not Linux: stop() still cleans up on a normal exit
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


@functools.cache
def libc_prctl() -> Any:
    """libc's prctl, looked up once in the parent: loading a library in a child forked from a
    process with threads (the gateway's, ``up``'s watchers) may deadlock on the loader's lock."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


#: the child's last lines of standard output kept (for error messages)
OUTPUT_LINES = 200


@dataclass
class ChildProcess:
    proc: subprocess.Popen[bytes]
    url: str
    name: str
    log_path: Path | None = None
    output: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_LINES))
    _drain: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def drain(self) -> None:
        """Keep reading the child's standard output (its last lines into ``output``): a pipe
        nobody reads fills up, and the child then blocks on its next write (a console span
        exporter blocked this way dropped spans and held shutdown)."""
        stdout = self.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()

        def read() -> None:
            partial = b""
            # whole reads, not lines: the pipe is unbuffered (one read per byte otherwise)
            with contextlib.suppress(OSError, ValueError):  # (closed by stop())
                while data := os.read(fd, 65536):
                    *lines, partial = (partial + data).split(b"\n")
                    self.output.extend(line.decode(errors="replace").rstrip() for line in lines)

        self._drain = threading.Thread(target=read, name=f"{self.name}-stdout", daemon=True)
        self._drain.start()

    def signal_stop(self) -> None:
        """SIGTERM without waiting (stopping several: all told first, then each waited for)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 5.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.signal_stop()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._drain is not None:
            self._drain.join(1.0)  # (the pipe's writer is gone: it reads to the end)
        # (a reader still blocked, the pipe held by a grandchild: closed under it, its next read
        # could take a reused descriptor's data; it ends with the pipe)
        if self.proc.stdout is not None and (self._drain is None or not self._drain.is_alive()):
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
    libc_prctl()  # (found here, before the fork: the child only calls it)
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=stderr,
        bufsize=0,  # read from the descriptor select() watches, not from a buffer it cannot see
        env={**os.environ, **(env or {})},
        preexec_fn=functools.partial(die_with_parent, os.getpid()),
        # a process group of its own: a terminal's Ctrl-C goes to this process alone, which stops
        # its children in order (`slogate up`: the gateway drains, then the engines stop). In the
        # terminal's group the engines got the same SIGINT at once and cut the streams draining.
        process_group=0,
    )
    if stderr is not None:
        stderr.close()
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen: deque[str] = deque(maxlen=OUTPUT_LINES)
    partial = b""
    deadline = time.monotonic() + startup_timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                data = os.read(fd, 65536)
                if data:
                    *lines, partial = (partial + data).split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace").rstrip()
                        seen.append(line)
                        match = _LISTENING.search(line)
                        if match:
                            child = ChildProcess(proc, match.group(1), name, log_path, seen)
                            child.drain()  # (what followed the line in the same read is only output)
                            return child
                    continue
            if proc.poll() is not None:
                break
    except BaseException:
        # interrupted while it starts (Ctrl-C): the caller has no handle on it yet to stop it
        ChildProcess(proc, "", name, log_path, seen).stop(1.0)
        raise
    child = ChildProcess(proc, "", name, log_path, seen)
    child.stop(1.0)
    last = " | ".join(list(seen)[-10:])
    raise RuntimeError(f"{name} did not start (exit {proc.returncode}); output: {last}")


def spawn_sim_engine(
    *args: str, name: str = "sim-engine", env: dict[str, str] | None = None, log_path: Path | None = None
) -> ChildProcess:
    """One simulated engine on a free port: ``slogate sim-engine --port 0 ARGS``."""
    return spawn_listening(
        [sys.executable, "-m", "gateway.sim.cli", "--port", "0", *args], name, env=env, log_path=log_path
    )
