"""Progress lines of real-engine provisioning that stay visible under pytest's output capture.

A cold cache costs about ten minutes of provisioning (vLLM venv, llama.cpp build, tiny models), all
inside one session fixture of the real-engine tier. pytest captures stderr at the file-descriptor
level by default, so lines written there only show up if a test fails: the run looks hung. Lines
therefore go to a *sink*: stderr by default (the ``slogate real-engine`` command), or the one
:func:`progress_to` installs; the tier's conftest installs :func:`terminal_sink`, which
writes through pytest's terminal reporter with capturing suspended for the moment of the write.

Every line says how long provisioning has been running; :func:`heartbeat` (called while a long
command or a lock wait is in progress) repeats the current step at most every ``HEARTBEAT_S``
seconds with the time spent in it and, from the caller, the command's latest log line.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

Sink = Callable[[str], None]
HEARTBEAT_S = 30.0
PREFIX = "slogate real-engines"


def stderr_sink(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: short enough for a progress line."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class ProgressReporter:
    """Numbered steps with the time since the first of them; heartbeats in between."""

    sink: Sink = stderr_sink
    clock: Callable[[], float] = time.monotonic
    heartbeat_s: float = HEARTBEAT_S
    started: float | None = None
    step_name: str = ""
    step_started: float = 0.0
    steps: int = 0
    last_line: float = field(default=0.0)

    def step(self, message: str) -> None:
        now = self.clock()
        if self.started is None:
            self.started = now
        self.steps += 1
        self.step_name = message
        self.step_started = now
        self._emit(now, f"[{self.steps}] {message}")

    def heartbeat(self, detail: str = "") -> None:
        """Repeat the current step if nothing was said for ``heartbeat_s`` (cheap to call often)."""
        now = self.clock()
        if self.started is None or now - self.last_line < self.heartbeat_s:
            return
        text = f"[{self.steps}] still {self.step_name} ({duration(now - self.step_started)} in this step)"
        if detail:
            text += f": {detail}"
        self._emit(now, text)

    def _emit(self, now: float, text: str) -> None:
        self.last_line = now
        assert self.started is not None
        line = f"[{PREFIX} {time.strftime('%H:%M:%S')} +{duration(now - self.started)}] {text}"
        try:
            self.sink(line)
        except (OSError, ValueError):  # a closed terminal must not fail the provisioning itself
            stderr_sink(line)


_reporter = ProgressReporter()


def progress(message: str) -> None:
    """Start a provisioning step: one line with the step and the time provisioning has taken."""
    _reporter.step(message)


def heartbeat(detail: str = "") -> None:
    """Say that the current step is still running (rate-limited; call it from wait loops)."""
    _reporter.heartbeat(detail)


@contextlib.contextmanager
def progress_to(sink: Sink, heartbeat_s: float = HEARTBEAT_S) -> Iterator[ProgressReporter]:
    """Send progress lines to ``sink`` (with a fresh clock) until the block ends."""
    global _reporter
    previous = _reporter
    _reporter = ProgressReporter(sink=sink, heartbeat_s=heartbeat_s)
    try:
        yield _reporter
    finally:
        _reporter = previous


def terminal_sink(config: pytest.Config) -> Sink:
    """A sink that writes to pytest's terminal even while pytest captures test output.

    (Not named ``pytest_...``: imported into a conftest, pytest would take it for a hook.)"""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:  # -p no:terminal: nothing better than stderr
        return stderr_sink

    def write(line: str) -> None:
        suspended = capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
        with suspended:
            # -q progress dots leave the cursor mid-line without pytest knowing (ensure_newline
            # only tracks file names), so start a line of our own
            writer = getattr(reporter, "_tw", None)
            if writer is not None and writer.width_of_current_line:
                reporter.write("\n")
            reporter.write_line(line)
            reporter.flush()  # before capturing resumes, or the line lands in the capture buffer

    return write


def last_log_line(path: Path, limit: int = 120) -> str:
    """The last non-empty line of a (growing) log file, shortened: what a long command is doing."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= limit else line[: limit - 3] + "..."
