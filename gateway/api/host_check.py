"""Which Host names a gateway listening on a loopback address answers (DNS rebinding).

A web page can point its own name at 127.0.0.1 once the browser has loaded it: its scripts then
reach a gateway on the operator's machine as same-origin, with no CORS preflight, and read
/dashboard/state or send requests, on a gateway without keys. Browsers always send the name
they resolved as Host, so a loopback gateway answers only the names that mean this machine (and
those the operator lists). A gateway listening on any other address is reached by name by
design (behind a load balancer, in a cluster): nothing is checked there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from gateway.api.errors import GatewayError

_LOCAL = frozenset({"localhost", "127.0.0.1", "::1"})


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HostCheck:
    def __init__(self, listen_host: str, allowed: Iterable[str]) -> None:
        extra = {name.lower().strip("[]") for name in allowed}
        #: None: any Host is answered
        self.names: frozenset[str] | None = (
            _LOCAL | extra if _loopback(listen_host) and "*" not in extra else None
        )

    def refusal(self, headers: Iterable[tuple[bytes, bytes]]) -> GatewayError | None:
        """The error for a request whose Host names no one this gateway answers, else None (an
        HTTP/1.0 request without a Host comes from no browser, and is answered)."""
        names = self.names
        if names is None:
            return None
        for name, value in headers:
            if name == b"host":
                return None if self._allowed(value, names) else self._error(value)
        return None

    @staticmethod
    def _allowed(value: bytes, names: frozenset[str]) -> bool:
        host = value.decode("latin-1").strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1 : host.find("]")]
        elif host.count(":") == 1:  # name:8000 (a bare IPv6 address has more)
            host = host.split(":")[0]
        return host in names or host.endswith(".localhost") or _loopback(host)

    @staticmethod
    def _error(value: bytes) -> GatewayError:
        shown = value.decode("latin-1")[:80]
        return GatewayError(
            400,
            f"this gateway listens on a loopback address and answers requests to this machine's "
            f"names only, not Host {shown!r} (a page that rebinds its name to 127.0.0.1 would read "
            "it); list the name in allowed_hosts to answer it",
            code="invalid_host",
        )
