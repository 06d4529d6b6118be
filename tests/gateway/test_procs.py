"""Child processes the CLI starts: started from their "listening" line, read while they run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gateway.procs import spawn_listening

_LISTEN = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
_ANNOUNCE = "print('x listening on http://127.0.0.1:%d' % s.getsockname()[1], flush=True); "


def test_a_listening_line_that_came_in_one_read_with_an_earlier_line_is_seen() -> None:
    """select() watched the pipe while readline() read a buffer: a line that arrived with an
    earlier one sat in the buffer unseen, and the healthy child was killed at the timeout."""
    child = _LISTEN + "print('loading weights...'); " + _ANNOUNCE + "import time; time.sleep(30)"
    # (before, spawn_listening raised at its timeout here)
    with spawn_listening([sys.executable, "-c", child], "two-lines", startup_timeout_s=20) as process:
        assert process.url.startswith("http://127.0.0.1:")
        assert "loading weights..." in process.output


def test_a_child_that_writes_a_lot_after_starting_is_not_blocked(tmp_path: Path) -> None:
    """The pipe was not read after start-up: a child writing more than it holds (a console span
    exporter) blocked in its write for good."""
    done = tmp_path / "done"
    child = (
        _LISTEN
        + _ANNOUNCE
        + "import sys, time; [print('span ' + 'x' * 200) for _ in range(5000)]; sys.stdout.flush(); "
        + f"open({str(done)!r}, 'w').close(); time.sleep(30)"
    )
    with spawn_listening([sys.executable, "-c", child], "chatty", startup_timeout_s=5) as process:
        deadline = time.monotonic() + 10
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.exists(), "the child blocked writing to its standard output"
        assert len(process.output) == 200 and process.output[-1].startswith("span ")


def test_a_real_engine_server_has_a_temporary_directory_of_its_own_removed_when_it_stops() -> None:
    from gateway.realengines.servers import _launch

    script = "import tempfile, time; tempfile.mkstemp(); print('ready', flush=True); time.sleep(60)"
    engine = _launch("llamacpp", "scratch-test", [sys.executable, "-c", script], 1, {})
    try:
        assert engine.scratch is not None
        deadline = time.monotonic() + 10
        while not any(engine.scratch.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(engine.scratch.iterdir())  # (its TMPDIR: what it made went there)
    finally:
        engine.stop()
    assert not engine.scratch.exists()


def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_exits() -> None:
    """The parent can die between the fork and the child's prctl: the child is then adopted by
    init, no death signal ever comes, and it ran on for good. It checks who its parent is after
    asking, and exits when that is no longer the pid that started it (here: a pid that is not
    its parent, as after the reparenting)."""
    script = "from gateway.procs import die_with_parent\ndie_with_parent({parent})\nprint('alive')\n"
    gone = subprocess.run([sys.executable, "-c", script.format(parent=1)], capture_output=True, text=True)
    assert gone.returncode == 1 and gone.stdout == "" and gone.stderr == ""
    kept = subprocess.run(
        [sys.executable, "-c", script.format(parent=os.getpid())], capture_output=True, text=True
    )
    assert kept.returncode == 0 and kept.stdout == "alive\n"
