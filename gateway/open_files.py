"""The open-files limit of a process that holds a socket per stream (the gateway, the simulated
engine). Kept apart from :mod:`gateway.runtime`, which brings the gateway's metrics with it."""

from __future__ import annotations

import contextlib
import resource


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the limit now
    in force. Every stream through the gateway holds two sockets (the client's and the
    engine's): the usual soft default of 1,024 capped it at ~500 streams, and past that each new
    connection failed."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
