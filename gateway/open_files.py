"""Sockets a process may open: its open-files limit (the gateway and the simulated engine hold a
socket per stream), and telling its own shortage of them from a peer's failure. Kept apart from
:mod:`gateway.runtime`, which brings the gateway's metrics with it."""

from __future__ import annotations

import contextlib
import errno
import resource

#: a connection attempt's errors that are this process's shortage, not the peer's fault: out of
#: file descriptors (process, system), socket buffers or memory. Every peer fails alike meanwhile.
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def out_of_sockets(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or aiohttp's connector error wrapping one) is this process
    running out of sockets rather than the peer refusing or missing."""
    os_error = getattr(exc, "os_error", exc)
    return isinstance(os_error, OSError) and os_error.errno in SHORTAGE_ERRNOS


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
