"""A gateway answers browsers on this machine's names only (DNS rebinding); others on any."""

from __future__ import annotations

import httpx
import pytest

from gateway.api.host_check import HostCheck
from tests.gateway.gateway_thread import run_gateway

BROWSER = [(b"sec-fetch-site", b"same-origin"), (b"sec-fetch-mode", b"cors")]


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
def test_the_names_a_loopback_gateway_answers_a_browser_on(host: bytes, answered: bool) -> None:
    check = HostCheck("127.0.0.1", ["gateway.internal"])
    assert (check.refusal([(b"host", host), *BROWSER]) is None) is answered
    assert check.refusal([(b"host", host), (b"origin", b"http://x")]) is None or not answered
    # a request no browser sent (the SDK, a probe, a reverse proxy passing its public name)
    assert check.refusal([(b"host", host)]) is None
    assert check.refusal(BROWSER) is None  # (no Host: HTTP/1.0)


def test_where_it_is_checked() -> None:
    assert HostCheck("0.0.0.0", []).names is None  # (reached by name by design: a cluster)
    assert HostCheck("10.0.0.5", []).names is None
    assert HostCheck("127.0.0.1", ["*"]).names is None
    assert HostCheck("::1", []).names is not None and HostCheck("localhost", []).names is not None
    # a container on 0.0.0.0 published on 127.0.0.1 (docker compose): checked once names are listed
    compose = HostCheck("0.0.0.0", ["gateway"])
    assert compose.refusal([(b"host", b"evil.example"), *BROWSER]) is not None
    assert compose.refusal([(b"host", b"localhost:8000"), *BROWSER]) is None


def test_a_rebound_page_cannot_read_the_dashboard_or_call_the_api() -> None:
    """A page that rebinds its name to 127.0.0.1 reaches a local gateway as same-origin (no CORS
    preflight): with no keys set it read every tenant's decisions from /dashboard/state."""
    browser = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}
    with run_gateway(engines=[]) as gw:
        for path, method in (
            ("/dashboard/state", "GET"),
            ("/v1/chat/completions", "POST"),
            ("/v1/models", "GET"),
        ):
            headers = {"Host": "attacker.example:8000", **browser}
            r = httpx.request(method, gw.url + path, headers=headers, json={})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (path, r.text)
        assert httpx.get(gw.url + "/dashboard/state", headers=browser).status_code == 200  # (127.0.0.1)
        assert httpx.get(gw.url + "/health", headers={"Host": "localhost", **browser}).status_code == 200
        # behind a local reverse proxy passing its public name: clients that are not browsers
        assert httpx.get(gw.url + "/health", headers={"Host": "llm.example.com"}).status_code == 200
    with run_gateway(engines=[], allowed_hosts=["*"]) as gw:
        headers = {"Host": "attacker.example", **browser}
        assert httpx.get(gw.url + "/health", headers=headers).status_code == 200
