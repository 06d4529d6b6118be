"""Start simulated engines as real child processes for tests and ops scripts.

``start_sim_engine(*args)`` runs ``python -m gateway.sim.cli --port 0 ARGS``, waits (at most
``startup_timeout`` s) for the one line ``slogate-sim listening on http://HOST:PORT`` and yields a
:class:`SimProcess` whose ``.url`` is that address. On exit the child gets SIGTERM, then SIGKILL
after 5 s. Standard error goes to a temporary file so a failed start shows the reason; stdout is
drained by a thread so a chatty child can never block on a full pipe.

Usage::

    with start_sim_engine("--profile", "qwen-7b", "--time-scale", "10") as engine:
        requests.post(engine.url + "/v1/completions", ...)

    async with async_sim_engine("--profile", "zero") as engine:   # same, from async code
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

LISTEN_PREFIX = "slogate-sim listening on "
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SimProcess:
    """A running sim engine: ``url`` is ``http://HOST:PORT``, ``pid`` the child's process id."""

    process: subprocess.Popen[str]
    url: str
    stderr_path: Path
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        with contextlib.suppress(OSError):
            self.stderr_path.unlink()
        return int(self.process.returncode)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies, so none is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def launch_sim_engine(
    *args: str, env: dict[str, str] | None = None, startup_timeout: float = 15.0
) -> SimProcess:
    """Start one engine and return once it listens; the caller must ``stop()`` it."""
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    err = tempfile.NamedTemporaryFile(prefix="sim-engine-", suffix=".err", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.sim.cli", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=child_env,
        cwd=REPO_ROOT,
    )
    err.close()
    found: list[str] = []
    ready = threading.Event()
    lines: list[str] = []

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if not found and line.startswith(LISTEN_PREFIX):
                found.append(line[len(LISTEN_PREFIX) :].strip())
                ready.set()
        ready.set()  # EOF: the child exited

    threading.Thread(target=read_stdout, name="sim-engine-stdout", daemon=True).start()
    handle = SimProcess(process, "", Path(err.name), lines)
    if not ready.wait(startup_timeout) or not found:
        handle.stop()
        raise RuntimeError(
            f"sim engine {' '.join(args)} did not start within {startup_timeout} s "
            f"(exit code {process.poll()}): {handle.stderr()[-2000:]}"
        )
    handle.url = found[0]
    return handle


@contextlib.contextmanager
def start_sim_engine(
    *args: str, env: dict[str, str] | None = None, startup_timeout: float = 15.0
) -> Iterator[SimProcess]:
    """Context manager around :func:`launch_sim_engine`; always stops the child."""
    handle = launch_sim_engine(*args, env=env, startup_timeout=startup_timeout)
    try:
        yield handle
    finally:
        handle.stop()


@contextlib.asynccontextmanager
async def async_sim_engine(
    *args: str, env: dict[str, str] | None = None, startup_timeout: float = 15.0
) -> AsyncIterator[SimProcess]:
    """The same from async code: start-up and shutdown run in a thread, not on the event loop."""
    handle = await asyncio.to_thread(launch_sim_engine, *args, env=env, startup_timeout=startup_timeout)
    try:
        yield handle
    finally:
        await asyncio.to_thread(handle.stop)
