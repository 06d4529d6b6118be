"""Render or lint a chart with Helm's Go SDK, in a child process: ``python helm_render.py`` reads
``{"op": "render"|"lint", "chart", "values", "release", "namespace"}`` as JSON on stdin and
writes ``{"ok", "result" | "error"}`` as JSON on stdout.

A separate process keeps Helm's Go runtime (loaded with ctypes) out of the pytest process, where
its signal handlers could meet pytest's own.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run(request: dict[str, Any]) -> dict[str, Any]:
    import helm_python as helm

    chart_dir: str = request["chart"]
    values: dict[str, Any] = request.get("values") or {}
    if request["op"] == "lint":
        report: dict[str, Any] = helm.lint(chart_dir, values, strict=True)
        return report
    with helm.Chart.load(chart_dir) as chart:
        manifests: dict[str, str] = chart.render(
            values, name=request["release"], namespace=request["namespace"], is_install=True
        )
        return {"manifests": manifests, "helm": helm.helm_sdk_version(), "merged": chart.merge_values(values)}


def main() -> int:
    request = json.load(sys.stdin)
    try:
        result = run(request)
    except Exception as exc:  # reported to the test, which decides what is a failure
        json.dump({"ok": False, "error": f"{type(exc).__name__}: {exc}"}, sys.stdout)
        return 0
    json.dump({"ok": True, "result": result}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
