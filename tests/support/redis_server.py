"""A real redis-server for the tests that share state: Debian's package, installed with apt-get
when missing (:mod:`tests.support.debian`), run by :class:`gateway.state.local_redis.LocalRedis`
(127.0.0.1, a free port, nothing persisted) and stopped by the test."""

from __future__ import annotations

import shutil

from gateway.state.local_redis import LocalRedis
from tests.support import debian


def redis_server_path() -> str:
    return debian.installed(("redis-server",), lambda: shutil.which("redis-server"))


class RedisServer(LocalRedis):
    def __init__(self) -> None:
        super().__init__(redis_server_path())
