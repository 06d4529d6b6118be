"""The processes docker-compose.yml names, run without containers, serve a request end to end.

Every service built from this repo's Dockerfile runs as its own process with the command line and
environment the compose file and the image give it (``slogate`` -> this interpreter's
``gateway.cli``), on 127.0.0.1 at ports chosen now; the gateway reads a copy of its mounted
config file with the service addresses rewritten. Prometheus (Debian's binary) runs with the
compose file's command and scrape configuration, the scrape interval shortened. Then: the
gateway turns ready, every health check (the image's and the compose file's) passes, one chat
completion streams through the gateway via the openai SDK, and Prometheus scrapes every target.
Grafana is not run (no package here); its provisioning is checked in test_compose.py.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from gateway.procs import ChildProcess, spawn_listening
from gateway.realengines.servers import late_bound_port
from tests.deploy.compose_model import Service, load_services, local_healthcheck, localize, start_order
from tests.gateway.conftest import free_port

READY_TIMEOUT_S = 20.0


def _wait(url: str, timeout_s: float, ok: int = 200) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    last: httpx.Response | Exception | None = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=2)
            if last.status_code == ok:
                return last
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{url} not {ok} after {timeout_s}s: {last!r}")


@pytest.fixture
def compose_stack(tmp_path: Path) -> Iterator[dict[str, Service]]:
    services = {n: s for n, s in load_services().items() if s.built_here}
    # (each service binds its port only once those before it are up)
    localize(services, {name: late_bound_port() for name in services}, tmp_path)
    running: list[ChildProcess] = []
    try:
        for name in start_order(services):
            svc = services[name]
            running.append(
                spawn_listening(svc.local_argv, name, env=svc.local_env, log_path=tmp_path / f"{name}.log")
            )
        yield services
    finally:
        for child in reversed(running):
            child.stop()


def test_compose_services_serve_a_chat_completion(
    compose_stack: dict[str, Service], prometheus_bin: Path, tmp_path: Path
) -> None:
    services = compose_stack
    gateway = services["gateway"]
    assert gateway.local_argv[-3:-1] == ["serve", "--config"]
    base = f"http://127.0.0.1:{gateway.local_port}"
    ready = _wait(f"{base}/ready", READY_TIMEOUT_S).json()
    assert ready["status"] == "ready"

    # every health check, as Docker would run it in the container, passes...
    for svc in services.values():
        proc = subprocess.run(local_healthcheck(svc), env=svc.local_env, capture_output=True, timeout=10)
        assert proc.returncode == 0, (svc.name, proc.stderr[-500:])
    # ...and fails against a port where nothing listens
    dead = {**gateway.local_env, "SLOGATE_PORT": str(free_port())}
    failed = subprocess.run(local_healthcheck(gateway), env=dead, capture_output=True, timeout=10)
    assert failed.returncode != 0

    engines = {e["id"]: e for e in httpx.get(f"{base}/admin/engines", timeout=5).json()["engines"]}
    sims = {n for n, s in services.items() if s.argv[1:2] == ["sim-engine"]}
    assert set(engines) == sims and all(e["healthy"] for e in engines.values())
    model = engines[sorted(sims)[0]]["model"]

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=[{"role": "user", "content": "Hello from the compose test!"}],
        max_tokens=8,
        stream=True,
    ) as response:
        served_by = response.headers["x-slogate-engine"]
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    assert served_by in sims

    _prometheus_scrapes_everything(services, prometheus_bin, tmp_path)


def _prometheus_scrapes_everything(
    services: dict[str, Service], prometheus_bin: Path, tmp_path: Path
) -> None:
    """Prometheus with the compose file's command and scrape config finds every target up."""
    prom = load_services()["prometheus"]
    port = free_port()
    localize(
        {**services, "prometheus": prom},
        {**{n: s.local_port or 0 for n, s in services.items()}, "prometheus": port},
        tmp_path / "prom",
    )
    config_arg = next(a for a in prom.local_argv if a.startswith("--config.file="))
    config_path = Path(config_arg.split("=", 1)[1])
    config = yaml.safe_load(config_path.read_text())
    config["global"]["scrape_interval"] = "1s"
    config_path.write_text(yaml.safe_dump(config))
    argv = [
        str(prometheus_bin / "prometheus"),
        *(a for a in prom.local_argv if not a.startswith("--storage.tsdb.path")),
        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/-/ready", READY_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        targets: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()["data"][
                "activeTargets"
            ]
            if targets and all(t["health"] == "up" for t in targets):
                break
            time.sleep(0.3)
        scraped = {str(t["scrapeUrl"]) for t in targets if t["health"] == "up"}
        expected = {f"http://127.0.0.1:{s.local_port}/metrics" for s in services.values()}
        assert scraped == expected, targets
        # the gateway's own series arrived through the scrape
        query = httpx.get(
            f"http://127.0.0.1:{port}/api/v1/query",
            params={"query": 'count({__name__=~"slogate_.+"})'},
            timeout=5,
        ).json()
        assert query["status"] == "success" and int(query["data"]["result"][0]["value"][1]) > 0, query
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
