"""A gateway listening on a loopback address answers this machine's names only (DNS rebinding)."""

from __future__ import annotations

import httpx
import pytest

from gateway.api.host_check import HostCheck
from tests.gateway.gateway_thread import run_gateway


@pytest.mark.parametrize(
    ("host", "answered"),
    [
        (b"127.0.0.1:8000", True),
        (b"localhost:8000", True),
        (b"LOCALHOST", True),
        (b"app.localhost:8000", True),
        (b"[::1]:8000", True),
        (b"127.0.0.2", True),
        (b"evil.example:8000", False),
        (b"evil.example", False),
        (b"127.0.0.1.evil.example", False),
        (b"gateway.internal:8000", True),  # (listed)
        (b"", False),
    ],
)
def test_the_names_a_loopback_gateway_answers(host: bytes, answered: bool) -> None:
    check = HostCheck("127.0.0.1", ["gateway.internal"])
    assert (check.refusal([(b"host", host)]) is None) is answered
    assert check.refusal([]) is None  # (no Host: HTTP/1.0, no browser)


def test_a_gateway_reached_by_name_by_design_checks_nothing() -> None:
    assert HostCheck("0.0.0.0", []).names is None
    assert HostCheck("10.0.0.5", []).names is None
    assert HostCheck("127.0.0.1", ["*"]).names is None
    assert HostCheck("::1", []).names is not None and HostCheck("localhost", []).names is not None


def test_a_rebound_page_cannot_read_the_dashboard_or_call_the_api() -> None:
    """A page that rebinds its name to 127.0.0.1 reaches a local gateway as same-origin (no CORS
    preflight): with no keys set it read every tenant's decisions from /dashboard/state."""
    with run_gateway(engines=[]) as gw:
        for path, method in (
            ("/dashboard/state", "GET"),
            ("/v1/chat/completions", "POST"),
            ("/v1/models", "GET"),
        ):
            r = httpx.request(method, gw.url + path, headers={"Host": "attacker.example:8000"}, json={})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (path, r.text)
        assert httpx.get(gw.url + "/health").status_code == 200  # (its own name: 127.0.0.1)
        assert httpx.get(gw.url + "/health", headers={"Host": "localhost"}).status_code == 200
    with run_gateway(engines=[], allowed_hosts=["*"]) as gw:
        assert httpx.get(gw.url + "/health", headers={"Host": "attacker.example"}).status_code == 200
