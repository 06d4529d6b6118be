"""The built-in status page: its JSON, its access rules, and the page itself rendered with live data
in headless Chromium against a gateway with simulated engines serving real requests."""

from __future__ import annotations

import base64
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.errors import GatewayError
from gateway.dashboard.state import MAX_DECISIONS, PAGE, parse_state_query
from gateway.procs import ChildProcess
from gateway.realengines.progress import progress_to, terminal_sink
from tests.gateway.conftest import MODEL, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until
from tests.gateway.stub_engines import HeaderEngine
from tests.support.browser import (
    INSTALL_TIMEOUT_S,
    BrowserError,
    BrowserUnavailable,
    Chromium,
    chromium_paths,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
ADMIN, CLIENT = "sk-dash-admin-0123456789", "sk-dash-client-0123456789"
#: a browser test's setup may install Chromium first (apt-get update and install, each bounded)
BROWSER_TIMEOUT_S = 2 * INSTALL_TIMEOUT_S + 120


def serve(gw: RunningGateway, n: int, task: str, stream: bool = True, key: str | None = None) -> None:
    headers = {"x-slo-task": task}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    for _ in range(n):
        r = httpx.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=headers, timeout=20
        )
        assert r.status_code == 200, r.text


def state(gw: RunningGateway, query: str = "", headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(gw.url + "/dashboard/state" + query, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def gateway(two_engines: list[ChildProcess]) -> Iterator[RunningGateway]:
    entries = [engine_entry(e) for e in two_engines]
    with run_gateway(engines=entries, monitor_interval_s=0.2, dashboard_decisions=40) as gw:
        yield gw


def _classes(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["slo_class"]: c for c in s["classes"]}


def test_state_shows_fleet_classes_and_decisions(gateway: RunningGateway) -> None:
    """Counts come from the process's metric registry, which earlier tests also fed: the checks
    compare the state before and after this test's own requests."""
    before = state(gateway).json()
    serve(gateway, 3, "medical_qa")
    serve(gateway, 2, "wikisql", stream=False)
    httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "model": "nope"}, timeout=10)
    s = state(gateway).json()
    assert [(e["id"], e["healthy"], e["model"]) for e in s["engines"]] == [
        ("e0", True, MODEL),
        ("e1", True, MODEL),
    ]
    assert all(e["kv_usage"] is not None and e["free_kv_tokens"] > 0 for e in s["engines"])
    assert s["dispatcher"] == "least-load" and s["slo_profile"] == "hyperflexis-4task"
    assert s["totals"]["requests"] - before["totals"]["requests"] == 6
    assert s["totals"]["by_status"]["4xx"] - before["totals"]["by_status"].get("4xx", 0) == 1
    classes, earlier = _classes(s), _classes(before)

    def added(cls: str, outcome: str | None = None) -> int:
        """How many more requests (or outcomes) the class has than before this test."""

        def count(c: dict[str, Any]) -> int:
            return int(c.get("requests", 0) if outcome is None else c.get("outcomes", {}).get(outcome, 0))

        return count(classes[cls]) - count(earlier.get(cls, {}))

    medical = classes["medical_qa"]
    assert added("medical_qa") == 3 and added("medical_qa", "met") == 3
    assert medical["ttft_target_ms"] == 700.0 and medical["ttft_mean_ms"] > 0 and medical["tpot_mean_ms"] > 0
    assert added("wikisql") == 2 and classes["p0"]["ttft_target_ms"] is None
    decisions = s["decisions"]
    assert decisions[0]["at"] >= decisions[-1]["at"]  # newest first
    # (a model nobody serves is refused at the front door, before any placement: no decision)
    latest = decisions[0:5]
    assert all(d["model"] != "nope" for d in decisions)
    assert [d["slo_class"] for d in latest] == ["wikisql"] * 2 + ["medical_qa"] * 3
    assert all(d["engine"] in ("e0", "e1") and d["refused"] is None and d["attempt"] == 1 for d in latest)
    assert len(state(gateway, "?decisions=2").json()["decisions"]) == 2
    assert len(state(gateway, "?decisions=1000").json()["decisions"]) <= 40
    # a number past the log (or past a few digits) is capped like any other, not refused; and no
    # answer carries more than MAX_DECISIONS, whatever the log keeps
    assert parse_state_query({"decisions": "1000000"}, 40) == 40
    assert parse_state_query({"decisions": "9" * 40}, 40) == 40
    assert parse_state_query({"decisions": "0000007"}, 40) == 7
    assert parse_state_query({"decisions": "50000"}, 100_000) == MAX_DECISIONS
    # (the log holds 40 at most: the query's own cap is what bounds an answer below the log's)
    assert (
        parse_state_query({"decisions": "1000"}, 40) == 40 and parse_state_query({"decisions": "7"}, 40) == 7
    )
    with pytest.raises(GatewayError) as info:
        parse_state_query({"x" * 10_000: "1"}, 40)
    assert len(info.value.message) < 200  # (an unknown parameter's name is not echoed whole)
    assert state(gateway, "?decisions=0").json()["decisions"] == []


def test_an_engine_out_of_rotation_is_not_shown_as_serving(gateway: RunningGateway) -> None:
    """An engine being drained (a role flip) or stalled stays healthy, and the page showed it as
    healthy and counted it among the serving engines: it takes no request meanwhile."""
    fleet = gateway.gateway.fleet
    assert fleet is not None
    loop = gateway.gateway.dispatch._task.get_loop()  # type: ignore[union-attr]

    def on_loop(change: Any) -> None:
        done = threading.Event()
        loop.call_soon_threadsafe(lambda: (change(), done.set()))
        assert done.wait(5)

    on_loop(lambda: fleet.set_draining("e0", True))
    try:
        engines = {e["id"]: e for e in state(gateway).json()["engines"]}
        assert engines["e0"]["healthy"] and engines["e0"]["draining"]
        assert not engines["e0"]["in_rotation"] and engines["e1"]["in_rotation"]
        # (a failed role flip leaves an engine draining with its role unknown: shown so)
        assert not engines["e0"]["role_unsure"]
        on_loop(lambda: setattr(fleet.records["e0"], "role_unsure", True))
        assert {e["id"]: e for e in state(gateway).json()["engines"]}["e0"]["role_unsure"]
    finally:
        on_loop(lambda: setattr(fleet.records["e0"], "role_unsure", False))
        on_loop(lambda: fleet.set_draining("e0", False))
    # (read in the same loop turn: the monitor's next stall check would undo a stall it does not see)
    from gateway.dashboard.state import _engines

    seen: list[list[dict[str, Any]]] = []
    on_loop(
        lambda: (
            fleet.set_stalled("e1", True),
            seen.append(_engines(gateway.gateway)),
            fleet.set_stalled("e1", False),
        )
    )
    engines = {e["id"]: e for e in seen[0]}
    assert engines["e1"]["stalled"] and not engines["e1"]["in_rotation"] and engines["e0"]["in_rotation"]


def test_bad_input_gets_openai_shaped_errors(gateway: RunningGateway) -> None:
    for query, param in (
        ("?decisions=-1", "decisions"),
        ("?decisions=x", "decisions"),
        ("?limit=3", "limit"),
    ):
        r = state(gateway, query)
        assert r.status_code == 400, query
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, query
    r = httpx.post(gateway.url + "/dashboard/state", timeout=10)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_queue_depth_per_model_and_class_and_refusals() -> None:
    """A held engine with one seat: the second request shows as queued under its model and class;
    a request refused by the dispatcher is a decision too."""
    gate = threading.Event()
    with (
        HeaderEngine(gate=gate) as held,
        # (no health check within the test: one would re-admit the engine it ejects at the end)
        run_gateway(engines=[held.entry("held")], max_engine_load=1, monitor_interval_s=30.0) as gw,
    ):
        threads = [
            threading.Thread(
                target=lambda: httpx.post(
                    gw.url + "/v1/chat/completions", json=CHAT, headers={"x-slo-task": "wikisql"}, timeout=20
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        assert wait_until(lambda: state(gw).json()["totals"]["queued"] == 1)
        s = state(gw).json()
        assert s["queues"] == [{"model": MODEL, "slo_class": "wikisql", "depth": 1}]
        assert s["engines"][0]["in_flight"] == 1
        gate.set()
        for t in threads:
            t.join(20)
        assert gw.gateway.fleet is not None
        gw.gateway.fleet.eject("held", "test")
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 503
        s = state(gw).json()
        assert s["queues"] == [{"model": MODEL, "slo_class": "wikisql", "depth": 0}]
        assert s["decisions"][0]["refused"] == "no_healthy_engine" and s["decisions"][0]["engine"] is None
        assert any(d["queue_wait_ms"] > 0 for d in s["decisions"])
        assert s["engines"][0]["healthy"] is False and s["engines"][0]["last_error"] == "test"


def test_access_is_that_of_metrics(two_engines: list[ChildProcess]) -> None:
    """With keys: an admin key (Bearer, or as a Basic password a browser can send); a client key
    is refused; a 401 asks the browser for Basic credentials. dashboard_public opens it alone."""
    entries = [engine_entry(two_engines[0])]
    basic = "Basic " + base64.b64encode(f"ops:{ADMIN}".encode()).decode()
    wrong = "Basic " + base64.b64encode(b"ops:sk-not-a-key").decode()
    with run_gateway(engines=entries, api_keys=[CLIENT], admin_api_keys=[ADMIN]) as gw:
        for path in ("/dashboard", "/dashboard/state"):
            r = httpx.get(gw.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert 'Basic realm="slogate dashboard"' in r.headers.get_list("www-authenticate")[0]
            assert httpx.get(gw.url + path, headers={"Authorization": f"Bearer {CLIENT}"}).status_code == 403
            assert httpx.get(gw.url + path, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
            assert httpx.get(gw.url + path, headers={"Authorization": basic}).status_code == 200
            assert httpx.get(gw.url + path, headers={"Authorization": wrong}).status_code == 401
            assert httpx.get(gw.url + path, headers={"Authorization": "Basic !!!"}).status_code == 401
        # Basic is for the dashboard only
        assert httpx.get(gw.url + "/metrics", headers={"Authorization": basic}).status_code == 401
    with run_gateway(engines=entries, api_keys=[CLIENT], admin_api_keys=[ADMIN], dashboard_public=True) as gw:
        assert httpx.get(gw.url + "/dashboard").status_code == 200
        assert httpx.get(gw.url + "/dashboard/state").status_code == 200
        assert httpx.get(gw.url + "/metrics").status_code == 401
        assert httpx.get(gw.url + "/admin/engines").status_code == 401
        # public is what /metrics shows: not the clients' request ids nor the engines' errors
        # (which name internal addresses); an admin key sees them
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        headers = {"Authorization": f"Bearer {CLIENT}", "X-Request-Id": "tenant-a-secret-42"}
        assert (
            httpx.post(gw.url + "/v1/chat/completions", json=chat, headers=headers, timeout=30).status_code
            == 200
        )
        gw.gateway.fleet.records[
            next(iter(gw.gateway.fleet.records))
        ].last_error = "cannot reach 10.0.3.7:8000"
        public = httpx.get(gw.url + "/dashboard/state").text
        assert "tenant-a-secret-42" not in public and "10.0.3.7" not in public
        for auth in (f"Bearer {ADMIN}", basic):
            full = httpx.get(gw.url + "/dashboard/state", headers={"Authorization": auth}).text
            assert "tenant-a-secret-42" in full and "10.0.3.7" in full, auth
        client = httpx.get(gw.url + "/dashboard/state", headers={"Authorization": f"Bearer {CLIENT}"}).text
        assert "tenant-a-secret-42" not in client


def test_the_page_fetches_nothing_from_elsewhere(gateway: RunningGateway) -> None:
    r = httpx.get(gateway.url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.content == PAGE
    html = r.text
    assert not re.search(r"<(img|iframe|object|embed)\b", html)
    assert re.findall(r"<link\b[^>]*>", html) == ['<link rel="icon" href="data:,">']  # no favicon fetch
    assert not re.search(r"""\b(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "http://" not in html and "https://" not in html
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "unsafe-inline" not in policy
    assert "frame-ancestors 'none'" in policy and r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
    # every script and style block the page has runs under the policy (a block the hashes missed
    # left the page dead, and only the browser test, skipped without Chromium, would have seen it)
    import base64
    import hashlib

    blocks = re.findall(r"<(script|style)\b[^>]*>(.*?)</\1>", html, re.S)
    assert blocks
    for _, block in blocks:
        digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy
    # the data route too, errors included: never read as anything but JSON
    for query in ("", "?decisions=x"):
        answer = httpx.get(gateway.url + "/dashboard/state" + query)
        assert answer.headers["x-content-type-options"] == "nosniff", query


# -- in a real browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(pytestconfig: pytest.Config) -> Iterator[Chromium]:
    """Skipped only when Chromium is not installed and cannot be: once it is, a driver or session
    that fails is a test failure."""
    with progress_to(terminal_sink(pytestconfig)):
        try:
            paths = chromium_paths()
        except BrowserUnavailable as exc:
            pytest.skip(f"headless Chromium unavailable: {exc}")
    with Chromium(paths) as chromium:
        yield chromium


ROWS = """return Array.from(document.querySelectorAll(arguments[0] + ' tbody tr'))
    .filter(r => !r.classList.contains('empty')).map(r => Array.from(r.cells).map(c => c.textContent));"""


@pytest.mark.timeout(BROWSER_TIMEOUT_S)
def test_the_page_renders_live_data_in_chromium(
    gateway: RunningGateway, browser: Chromium, tmp_path: Path
) -> None:
    before = state(gateway).json()
    serve(gateway, 3, "medical_qa")
    serve(gateway, 1, "tldr_headline_gen", stream=False)
    browser.get(gateway.url + "/dashboard")
    browser.wait_for("return Number(document.body.dataset.updates) >= 1")
    engines = browser.script(ROWS, "#engines")
    assert [(row[0], row[1], row[3]) for row in engines] == [
        ("e0", MODEL, "healthy"),
        ("e1", MODEL, "healthy"),
    ]
    assert all(row[7].endswith("%") for row in engines)  # KV usage scraped from the engines
    # the page shows the gateway's counts, which hold earlier tests' requests too: exactly those
    # plus this test's
    requests = int(browser.script("return document.getElementById('total-requests').textContent"))
    assert requests == before["totals"]["requests"] + 4
    assert browser.script("return document.getElementById('total-healthy').textContent") == "2 / 2"
    classes = {row[0]: row for row in browser.script(ROWS, "#classes")}
    medical_before = _classes(before).get("medical_qa", {"requests": 0})["requests"]
    assert int(classes["medical_qa"][3]) == int(medical_before) + 3
    assert classes["medical_qa"][4].strip().endswith("%")
    decisions = browser.script(ROWS, "#decisions")
    assert len(decisions) >= 4 and any(row[6] in ("→ e0", "→ e1") for row in decisions)
    assert {row[3] for row in decisions[:4]} == {"medical_qa", "tldr_headline_gen"}
    # live: the page polls, so new traffic shows without a reload
    serve(gateway, 2, "wikisql")
    browser.wait_for(
        "return Number(document.getElementById('total-requests').textContent) >= arguments[0]",
        15,
        requests + 2,
    )
    browser.wait_for(
        "return Array.from(document.querySelectorAll('#decisions tbody tr'))"
        ".some(r => r.cells[3] && r.cells[3].textContent === 'wikisql')"
    )
    # everything the page loaded came from the gateway
    loaded = browser.script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(gateway.url + "/dashboard/state?") for url in loaded), loaded
    browser.screenshot(tmp_path / "dashboard.png")


@pytest.mark.timeout(BROWSER_TIMEOUT_S)
def test_the_page_signs_in_with_basic_credentials(two_engines: list[ChildProcess], browser: Chromium) -> None:
    """With admin keys set, a browser opening the page with the admin key as its Basic password
    renders live data (the page's own polls carry the same credentials)."""
    entries = [engine_entry(e) for e in two_engines]
    with run_gateway(
        engines=entries, api_keys=[CLIENT], admin_api_keys=[ADMIN], monitor_interval_s=0.2
    ) as gw:
        serve(gw, 2, "medical_qa", key=CLIENT)
        browser.get(gw.url.replace("http://", f"http://ops:{ADMIN}@") + "/dashboard")
        browser.wait_for("return Number(document.body.dataset.updates) >= 2")
        assert len(browser.script(ROWS, "#engines")) == 2
        browser.get(gw.url + "/dashboard/nope")  # leave the page before the gateway stops


def test_a_failing_browser_session_is_an_error_not_a_skip() -> None:
    """With Chromium installed, a session that cannot start raises BrowserError (which the fixture
    lets through as a failure), never BrowserUnavailable (which it skips on)."""
    try:
        _, driver = chromium_paths()
    except BrowserUnavailable as exc:
        pytest.skip(f"headless Chromium unavailable: {exc}")
    with (
        pytest.raises(BrowserError, match="webdriver POST /session"),
        Chromium(("/nonexistent/chromium", driver)),
    ):
        pass
    assert not issubclass(BrowserError, BrowserUnavailable)


@pytest.mark.timeout(BROWSER_TIMEOUT_S)
def test_a_poll_that_never_answers_is_shown_not_waited_for(
    gateway: RunningGateway, browser: Chromium
) -> None:
    """A poll left unanswered (a stopped gateway, a half-open connection) was waited for: the
    page stopped polling for good while it still read "updated ... every 2 s"."""
    import asyncio

    from aiohttp import web

    from gateway.dashboard.state import PAGE_HEADERS
    from tests.support.threaded_app import ThreadedApp

    answer = state(gateway).content  # (a real state, for the first poll)

    class Stuck(ThreadedApp):
        thread_name = "stuck-dashboard"

        def __init__(self) -> None:
            super().__init__()
            self.polls = 0
            self._release = asyncio.Event()

        async def before_cleanup(self) -> None:
            self._release.set()

        async def build(self) -> web.Application:
            async def page(_: web.Request) -> web.Response:
                return web.Response(body=PAGE, content_type="text/html", headers=PAGE_HEADERS)

            async def data(_: web.Request) -> web.Response:
                self.polls += 1
                if self.polls > 1:
                    await self._release.wait()
                return web.Response(body=answer, content_type="application/json")

            app = web.Application()
            app.router.add_get("/dashboard", page)
            app.router.add_get("/dashboard/state", data)
            return app

    with Stuck() as stuck:
        browser.get(stuck.url + "/dashboard")
        browser.wait_for("return Number(document.body.dataset.updates) >= 1")
        browser.wait_for("return document.getElementById('status').className === 'bad'", 20)
        assert "not answering" in browser.script("return document.getElementById('status').textContent")
        assert stuck.polls >= 2
