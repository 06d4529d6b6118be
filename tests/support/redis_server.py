"""A real redis-server for the tests that share state: Debian's package, installed with apt-get
when missing (:mod:`tests.support.debian`), started on 127.0.0.1 and a free port with nothing
persisted, stopped by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import Self

from tests.support import debian


def redis_server_path() -> str:
    return debian.installed(("redis-server",), lambda: shutil.which("redis-server"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; a context manager. :meth:`stop` and :meth:`start` again (same
    port, data gone) play an outage."""

    def __init__(self) -> None:
        self.path = redis_server_path()
        self.port = _free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="slogate-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                self.path,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir.name,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
