"""Which Host names a gateway answers a browser on (DNS rebinding).

A web page can point its own name at 127.0.0.1 once the browser has loaded it: its scripts then
reach a gateway on the operator's machine as same-origin, with no CORS preflight, and read
/dashboard/state or send requests, on a gateway without keys. The browser sends the name it
resolved as Host, and marks its requests (``Sec-Fetch-*``, ``Origin``): a browser's request for a
name that is not this machine's (nor one the operator lists) is refused. Requests no browser sent
(the SDK, a probe, a reverse proxy's client) are not: a gateway on 127.0.0.1 behind a local proxy
that passes its public name as Host keeps serving them.

Checked when the gateway listens on a loopback address (``slogate up``, a bare-metal
``slogate serve``), or wherever ``allowed_hosts`` names anything (a container listening on
0.0.0.0 and published on 127.0.0.1, as docker compose runs it); ``*`` turns it off.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from gateway.api.errors import GatewayError

_LOCAL = frozenset({"localhost", "127.0.0.1", "::1"})
#: headers only browsers send (fetch metadata; Origin on CORS and POST requests)
_BROWSER = frozenset({b"sec-fetch-site", b"sec-fetch-mode", b"origin"})


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
        checked = (_loopback(listen_host) or bool(extra)) and "*" not in extra
        #: None: any Host is answered
        self.names: frozenset[str] | None = _LOCAL | extra if checked else None

    def refusal(self, headers: Iterable[tuple[bytes, bytes]]) -> GatewayError | None:
        """The error for a browser's request whose Host names no one this gateway answers, else
        None (an HTTP/1.0 request without a Host comes from no browser either)."""
        names = self.names
        if names is None:
            return None
        host = None
        browser = False
        for name, value in headers:
            if name == b"host":
                host = value
            elif name in _BROWSER:
                browser = True
        if host is None or not browser or self._allowed(host, names):
            return None
        return self._error(host)

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
            f"this gateway answers browsers on this machine's names only, not Host {shown!r} (a "
            "page that rebinds its name to 127.0.0.1 would read it); list the name in "
            "allowed_hosts to answer it",
            code="invalid_host",
        )
