"""A redis-server of this machine's, started on 127.0.0.1 and a free port with nothing persisted:
what the replica benchmark and the tests share state through."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import Self


class RedisUnavailable(Exception):
    """No redis-server program on this machine (the message says how to get one)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def server_pid(port: int) -> int | None:
    """The process id of the Redis server answering on ``port`` (None if none says)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.split(b"process_id:", 1)[1].count(b"\r\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    _, found, rest = data.partition(b"process_id:")
    digits = rest.split(b"\r\n", 1)[0]
    return int(digits) if found and digits.isdigit() else None


class LocalRedis:
    """One redis-server process; a context manager. :meth:`stop` and :meth:`start` again (same
    port, data gone) play an outage."""

    def __init__(self, path: str | None = None) -> None:
        found = path or shutil.which("redis-server")
        if found is None:
            raise RedisUnavailable("redis-server is not installed (Debian: apt-get install redis-server)")
        self.path = found
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="slogate-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the server; on another port if another server took this one meanwhile (its port
        is chosen free, then released for redis-server to bind: a test talking to another
        process's server would flush its data)."""
        for attempt in range(3):
            if self._start_once():
                return
            self.stop()
            if attempt < 2:
                self.port = free_port()
        raise RuntimeError(f"redis-server did not start on a port of its own (last tried {self.port})")

    def _start_once(self) -> bool:
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
        while True:
            if self._proc.poll() is not None:
                return False  # (its port taken, most likely)
            if answers(self.port):
                return server_pid(self.port) == self._proc.pid  # (ours, not another's)
            if time.monotonic() > deadline:
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
