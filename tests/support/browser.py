"""Headless Chromium for page tests: Debian's chromium and chromedriver, driven over the W3C WebDriver
protocol with httpx (no Selenium, no browser download).

:func:`chromium_paths` installs both packages with apt-get when they are missing (once per machine,
under a file lock so parallel test processes do not race; progress lines while it runs, at most
:data:`INSTALL_TIMEOUT_S`) and returns their paths, or raises :class:`BrowserUnavailable` saying why
it could not: the one condition a test may skip on. :class:`Chromium` starts chromedriver on a free
port and one headless session, with the flags this machine's closed network needs (no background
networking, component updates or sync, which would otherwise try to reach the internet); once the
browser is installed, anything that goes wrong (the driver, the session, a command) raises
:class:`BrowserError`, a failure.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from tests.support import debian

PACKAGES = ("chromium", "chromium-driver")
INSTALL_TIMEOUT_S = debian.INSTALL_TIMEOUT_S


class BrowserUnavailable(Exception):
    """Chromium or chromedriver is missing and could not be installed (the message says why)."""


class BrowserError(RuntimeError):
    """The installed browser or its driver failed: a test failure, never a reason to skip."""


def _found() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def chromium_paths() -> tuple[str, str]:
    """(chromium, chromedriver), installing Debian's packages first when they are missing."""
    try:
        return debian.installed(PACKAGES, _found)
    except debian.PackageUnavailable as exc:
        raise BrowserUnavailable(str(exc)) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Chromium:
    """One headless Chromium session through chromedriver; a context manager."""

    def __init__(self, paths: tuple[str, str] | None = None, width: int = 1400, height: int = 1000) -> None:
        """``paths``: (chromium, chromedriver), from :func:`chromium_paths` when None."""
        self.browser, self.driver = paths if paths is not None else chromium_paths()
        self.size = (width, height)
        self._profile = tempfile.TemporaryDirectory(prefix="slogate-chromium-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: httpx.Client | None = None
        self._session = ""

    def __enter__(self) -> Self:
        port = _free_port()
        self._proc = subprocess.Popen(
            [self.driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if self._http.get("/status").json()["value"]["ready"]:
                    break
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.__exit__(None, None, None)
                raise BrowserError(f"{self.driver} did not start")
            time.sleep(0.05)
        args = [
            "--headless=new",
            "--no-sandbox",  # tests run as root here
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--window-size={self.size[0]},{self.size[1]}",
            f"--user-data-dir={self._profile.name}",
        ]
        capabilities = {"browserName": "chrome", "goog:chromeOptions": {"binary": self.browser, "args": args}}
        try:
            value = self._command("POST", "/session", {"capabilities": {"alwaysMatch": capabilities}})
        except BaseException:
            self.__exit__(None, None, None)  # the driver process must not outlive the failure
            raise
        self._session = value["sessionId"]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._session and self._http is not None:
            with contextlib.suppress(httpx.HTTPError, BrowserError):
                self._command("DELETE", f"/session/{self._session}")
        if self._http is not None:
            self._http.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._profile.cleanup()

    def _command(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self._http is not None
        response = self._http.request(method, path, json=body if body is not None else None)
        value = response.json().get("value")
        if response.status_code >= 400:
            raise BrowserError(f"webdriver {method} {path}: {value}")
        return value

    # -- the session -------------------------------------------------------------------------------

    def get(self, url: str) -> None:
        self._command("POST", f"/session/{self._session}/url", {"url": url})

    def script(self, source: str, *args: Any) -> Any:
        """Run ``source`` as a function body in the page (``return`` gives the result)."""
        return self._command(
            "POST", f"/session/{self._session}/execute/sync", {"script": source, "args": list(args)}
        )

    def wait_for(self, source: str, timeout: float = 15.0, *args: Any) -> Any:
        """Poll ``source`` until it returns something truthy; that value, or an AssertionError."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.script(source, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"page never satisfied: {source}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        data = self._command("GET", f"/session/{self._session}/screenshot")
        path.write_bytes(base64.b64decode(data))


__all__ = ["INSTALL_TIMEOUT_S", "BrowserError", "BrowserUnavailable", "Chromium", "chromium_paths"]
