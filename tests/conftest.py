"""How the suite spreads over pytest-xdist workers (``-n 2 --dist loadgroup``, set in pyproject).

Each test module is one unit of work, so a module's fixtures (engines, gateways) start once. The
modules that provision machine-wide tools (real engines, the deployment toolchain, Chromium: some
install with apt-get, whose lock allows one installer at a time) and start the heaviest servers
form a single unit run first, by one worker, while the other worker takes the remaining modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: the directories and modules that provision with apt-get or into ~/.cache/slogate
PROVISIONING = (HERE / "realengines", HERE / "deploy", HERE / "gateway" / "test_dashboard.py")
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
    # (xdist hands out units in collection order with --no-loadscope-reorder: the longest goes first)
    items[:] = first + rest
