"""How the suite spreads over pytest-xdist workers (``-n 3 --dist loadgroup``, set in pyproject).

Each test module is one unit of work, so a module's fixtures (engines, gateways) start once. The
modules that provision machine-wide tools (real engines, the deployment toolchain, Chromium: some
install with apt-get, whose lock allows one installer at a time) and start the heaviest servers
form a single unit run first, by one worker, while the other workers take the remaining modules.

A test marked ``alone`` measures wall-clock time against a bound (live against offline, an abort
within 100 ms, which of two requests a busy engine finishes first): it runs while the other workers
run no test, since a neighbour that keeps both cores busy (starting vLLM takes a minute of both)
would stretch its timings. Every test holds a lock on a file the workers share while it runs, from
the setup of its fixtures to their teardown: ``alone`` ones exclusively, the others shared.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: the directories and modules that provision with apt-get (redis-server, Chromium, Prometheus) or
#: into ~/.cache/slogate
PROVISIONING = (HERE / "realengines", HERE / "deploy", HERE / "state", HERE / "gateway" / "test_dashboard.py")
PROVISIONING_GROUP = "provisioning"


def _provisions(path: Path) -> bool:
    return any(path == p or p in path.parents for p in PROVISIONING)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        path = Path(str(item.fspath))
        if _provisions(path):
            item.add_marker(pytest.mark.xdist_group(PROVISIONING_GROUP))
            first.append(item)
        else:
            item.add_marker(pytest.mark.xdist_group(f"{path.parent.name}.{path.stem}"))
            rest.append(item)
    # xdist hands out units in collection order (--no-loadscope-reorder): the longest first, the
    # modules with tests that run alone last, when the real engines have started (or, on a cold
    # machine, been provisioned) and the other workers have no long wait for its lock
    alone = {item.path for item in rest if item.get_closest_marker("alone")}
    items[:] = first + [i for i in rest if i.path not in alone] + [i for i in rest if i.path in alone]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "alone: measures wall-clock timing; with xdist, no other test runs meanwhile"
    )


def _lock_paths(config: pytest.Config) -> tuple[Path, Path] | None:
    """The lock the tests hold while they run, and the gate taken to ask for it (see below); in
    the run's base temporary directory, which every worker's own lies in."""
    if getattr(config, "workerinput", None) is None:
        return None  # one process: tests run one at a time anyway
    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]
    shared = factory.getbasetemp().parent
    return shared / "tests-running.lock", shared / "tests-gate.lock"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # (outside pytest-timeout's timer: waiting is no test time)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    paths = _lock_paths(item.config)
    if paths is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    with paths[0].open("a") as lock, paths[1].open("a") as gate:
        # Linux grants a shared flock while an exclusive one waits, so a worker running short
        # tests back to back could keep an ``alone`` test waiting: the gate lets one in at a time
        fcntl.flock(gate, mode)
        fcntl.flock(lock, mode)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
