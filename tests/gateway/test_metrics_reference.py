"""The metrics reference cannot drift: the table in docs/observability.md is the live registry's,
every metric is recorded by some code, and every PromQL expression in the Grafana dashboard names
metrics and labels that exist."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser

from gateway import metrics

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "observability.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "slogate-dashboard.json"
#: what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def test_the_docs_table_is_the_registry() -> None:
    text = DOC.read_text()
    match = re.search(r"<!-- metrics-table:start -->\n(.*?)<!-- metrics-table:end -->", text, flags=re.S)
    assert match, "docs/observability.md lost its metrics-table markers"
    assert match.group(1) == metrics.reference_table(), (
        "docs/observability.md's metrics table differs from gateway/metrics.py; regenerate it with "
        "`python -m gateway.metrics` and paste it between the markers"
    )


def test_every_metric_is_recorded_somewhere() -> None:
    """No placeholder: each metric object is used outside its definition (by its Python name)."""
    definitions = ROOT / "gateway" / "metrics.py"
    defined = re.findall(r"^([A-Z_]+) = (?:Counter|Gauge|Histogram)\(", definitions.read_text(), re.M)
    assert len(defined) == len({m.name for m in metrics.REGISTRY.collect()})
    sources = "\n".join(p.read_text() for p in (ROOT / "gateway").rglob("*.py") if p != definitions)
    unused = [name for name in defined if not re.search(rf"\bmetrics\.{name}\b", sources)]
    assert not unused, f"metrics defined but recorded nowhere: {unused}"


# -- the Grafana dashboard -----------------------------------------------------------------------


def _expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            found = re.fullmatch(r"label_values\((\w+), *(\w+)\)", query)
            assert found, f"variable {variable['name']}: only label_values(metric, label) is checked"
            yield f"variable {variable['name']}", f"count by ({found.group(2)}) ({found.group(1)})"


def _substitute(expr: str, variables: list[str]) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    for name in variables:
        expr = expr.replace(f"${name}", ".*")
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def _references(expr: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(metric name, label names matched) of every selector, and every grouping label."""
    selectors: list[tuple[str, list[str]]] = []
    grouping: list[str] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            selectors.append((node.name, [m.name for m in node.matchers.matchers]))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.extend(node.modifier.labels)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return selectors, grouping


def test_the_grafana_dashboard_names_only_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = metrics.series_names()
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    checked = 0
    for where, raw in _expressions(dashboard):
        selectors, grouping = _references(_substitute(raw, variables))
        assert selectors, f"{where}: no metric in {raw!r}"
        labels: set[str] = set()
        for name, matched in selectors:
            assert name in series, f"{where}: {name} is not a metric the gateway exports"
            known = set(series[name]) | ({"le"} if name.endswith("_bucket") else set())
            unknown = set(matched) - known
            assert not unknown, f"{where}: {name} has no label {sorted(unknown)}"
            labels |= known
        assert set(grouping) <= labels, f"{where}: grouped by {sorted(set(grouping) - labels)}, not a label"
        checked += 1
    assert checked >= 30


def test_the_grafana_dashboard_covers_what_operators_need() -> None:
    """SLO attainment per class, TTFT/TPOT percentiles, queue, engine load and KV usage: each has
    a panel; every panel has a unique id, a place on the grid and the data source variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needed in (
        'slogate_slo_requests_total{outcome="met"',
        "slogate_time_to_first_token_seconds_bucket",
        "slogate_time_per_output_token_seconds_bucket",
        "slogate_queue_depth",
        "slogate_queue_wait_seconds_bucket",
        "slogate_engine_in_flight",
        "slogate_engine_kv_usage",
        "slogate_sheds_total",
        "slogate_policy_call_seconds_bucket",
        "slogate_dispatch_call_seconds_bucket",
    ):
        assert needed in exprs, needed
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


#: engine gauges every gateway replica reports alike (the engine's own state, or the gateway's
#: view of its health): summing them over replicas would count each engine once per replica
ENGINE_REPORTED = (
    "slogate_engine_healthy",
    "slogate_engine_running",
    "slogate_engine_waiting",
    "slogate_engine_kv_usage",
)


def test_the_grafana_dashboard_counts_each_engine_once() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    seen = 0
    for where, expr in _expressions(dashboard):
        if not where.startswith("panel"):  # a variable only lists label values
            continue
        for name in ENGINE_REPORTED:
            for found in re.finditer(rf"\b{name}\b", expr):
                seen += 1
                before = expr[: found.start()]
                assert before.endswith("max by (engine) ("), (
                    f"{where}: {name} not taken as max by (engine): {expr}"
                )
    assert seen >= 4
