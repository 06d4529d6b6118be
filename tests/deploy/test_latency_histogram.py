"""The Locust load test's latency histogram: bounded memory however long the run, percentiles within
1 % of the exact nearest-rank ones, mergeable across workers through JSON."""

from __future__ import annotations

import ast
import json
import math
import random

import pytest

from loadtest.latency_histogram import RATIO, LatencyHistogram
from tests.deploy.compose_model import REPO


def exact(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def samples(n: int, seed: int = 7) -> list[float]:
    rng = random.Random(seed)
    # TTFT-like: a lognormal body (tens to thousands of ms) and a few far outliers
    return [rng.lognormvariate(5.0, 1.2) for _ in range(n)] + [rng.uniform(1e5, 1e6) for _ in range(n // 100)]


def test_percentiles_are_within_one_percent() -> None:
    values = samples(20_000)
    h = LatencyHistogram()
    for v in values:
        h.add(v)
    assert h.count == len(values) and h.min == min(values) and h.max == max(values)
    for q in (1, 10, 50, 90, 99, 99.9, 100):
        got = h.percentile(q)
        assert got is not None
        assert got == pytest.approx(exact(values, q), rel=(RATIO - 1) / 2 + 1e-9), q


def test_memory_is_bounded_however_many_samples() -> None:
    """A million samples over nine decades: at most a few thousand counters, not a million floats."""
    rng = random.Random(3)
    h = LatencyHistogram()
    for _ in range(1_000_000):
        h.add(10 ** rng.uniform(-3, 6))
    assert h.count == 1_000_000
    assert len(h.buckets) <= math.ceil(9 * math.log(10) / math.log(RATIO)) + 1  # about 1,050


def test_merging_workers_equals_one_histogram() -> None:
    values = samples(5_000)
    whole, parts = LatencyHistogram(), [LatencyHistogram() for _ in range(3)]
    for i, v in enumerate(values):
        whole.add(v)
        parts[i % 3].add(v)
    merged = LatencyHistogram()
    for part in parts:
        # what a worker sends the master: JSON
        merged.merge(LatencyHistogram.from_dict(json.loads(json.dumps(part.to_dict()))))
    assert merged.buckets == whole.buckets and merged.count == whole.count
    assert (merged.min, merged.max) == (whole.min, whole.max)
    assert [merged.percentile(q) for q in (50, 90, 99)] == [whole.percentile(q) for q in (50, 90, 99)]


def test_edges() -> None:
    empty = LatencyHistogram()
    assert empty.percentile(50) is None
    assert LatencyHistogram.from_dict(json.loads(json.dumps(empty.to_dict()))).count == 0
    one = LatencyHistogram()
    one.add(123.4)
    one.add(math.nan)  # not a latency: ignored
    assert one.count == 1 and one.percentile(1) == one.percentile(100) == 123.4  # clamped to the sample
    tiny = LatencyHistogram()
    tiny.add(0.0)
    assert tiny.percentile(50) == 0.0


def test_the_locustfile_keeps_histograms_not_samples() -> None:
    """ClassStats (per class, on every worker and the master) holds histograms, never sample lists."""
    tree = ast.parse((REPO / "loadtest" / "locustfile.py").read_text())
    stats = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ClassStats")
    fields = {
        node.target.id: ast.unparse(node.annotation)
        for node in stats.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    assert fields["ttft_ms"] == fields["tpot_ms"] == "LatencyHistogram"
    assert not [f for f, annotation in fields.items() if annotation.startswith("list")]
