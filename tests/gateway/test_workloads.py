"""The workload library: arrival processes, length mixes, multi-turn prefixes, YAML specs."""

from __future__ import annotations

import itertools
import random
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from gateway.experiments.arrivals import Gamma, Poisson, Trace, arrival_times, read_trace
from gateway.experiments.generators import Task
from gateway.experiments.prompts import prompt_token_ids, spec_prompt_text
from gateway.experiments.workload import HYPERFLEXIS_2TASK, HYPERFLEXIS_4TASK, RequestSpec, TaskSpec
from gateway.experiments.workloads import list_workloads, load_workload, read_workload, workloads_dir
from gateway.tokenizer import encode

SHIPPED = {
    "bursty",
    "calibration",
    "hyperflexis-2task",
    "hyperflexis-4task",
    "long-tail",
    "multi-turn",
    "prefix-sessions",
    "prefix-trap",
    "prefix-history",
    "priority-ramp",
    "tpot-bound",
    "trace-mmpp",
}


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise([0.0, *times])]


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def _quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    first = load_workload(name, qps=8.0, requests=120, seed=3)
    assert first == load_workload(name, qps=8.0, requests=120, seed=3)
    assert first != load_workload(name, qps=8.0, requests=120, seed=4)
    assert [prompt_token_ids(r) for r in first[:20]] == [prompt_token_ids(r) for r in first[:20]]


@pytest.mark.parametrize("process", [Poisson(), Gamma(cv=2.0), Gamma(cv=4.0)], ids=repr)
def test_arrivals_keep_the_mean_rate(process: Poisson | Gamma) -> None:
    times = arrival_times(process, random.Random(7), 20.0, count=20_000)
    assert len(times) == 20_000 and all(a <= b for a, b in itertools.pairwise(times))
    assert len(times) / times[-1] == pytest.approx(20.0, rel=0.08)


def test_gamma_gaps_have_the_requested_cv() -> None:
    poisson_cv = _cv(_gaps(arrival_times(Poisson(), random.Random(1), 5.0, count=20_000)))
    assert poisson_cv == pytest.approx(1.0, abs=0.05)
    for cv, tolerance in ((2.0, 0.08), (4.0, 0.15)):
        measured = _cv(_gaps(arrival_times(Gamma(cv), random.Random(1), 5.0, count=20_000)))
        assert measured > 1.5 and measured == pytest.approx(cv, rel=tolerance)


def test_arrivals_stop_at_the_horizon() -> None:
    times = arrival_times(Poisson(), random.Random(2), 10.0, count=10_000, until=30.0)
    assert 200 < len(times) < 400 and times[-1] < 30.0
    with pytest.raises(ValueError, match="count, until"):
        arrival_times(Poisson(), random.Random(2), 10.0)


def _check_table1(loaded: list[RequestSpec], table: tuple[TaskSpec, ...], per_task: int, rel: float) -> None:
    assert {r.task for r in loaded[:40]} == {t.name for t in table}  # interleaved, not in blocks
    by_task: dict[str, list[RequestSpec]] = defaultdict(list)
    for r in loaded:
        by_task[r.task].append(r)
    assert set(by_task) == {t.name for t in table}
    for task in table:
        mine = by_task[task.name]
        assert len(mine) == per_task  # equal shares, as HyperFlexis draws them
        assert (mine[0].ttft_s, mine[0].tpot_s) == (task.ttft_s, task.tpot_s)
        prompts = [r.prompt_tokens for r in mine]
        outputs = [r.output_tokens for r in mine]
        assert statistics.fmean(prompts) == pytest.approx(task.input_mean, rel=rel), task.name
        assert statistics.fmean(outputs) == pytest.approx(task.output_mean, rel=rel), task.name
        assert statistics.pstdev(prompts) == pytest.approx(task.input_std, rel=3 * rel), task.name
        assert statistics.pstdev(outputs) == pytest.approx(task.output_std, rel=3 * rel), task.name


def test_hyperflexis_sets_reproduce_table1() -> None:
    # the YAML and the constants the live runner uses are one table
    assert read_workload("hyperflexis-4task").tasks == tuple(Task.from_spec(t) for t in HYPERFLEXIS_4TASK)
    _check_table1(
        load_workload("hyperflexis-4task", qps=50, requests=8000, seed=0), HYPERFLEXIS_4TASK, 2000, 0.04
    )
    # sharegpt's heavy spread (std > mean) needs more samples for the same confidence
    _check_table1(
        load_workload("hyperflexis-2task", qps=50, requests=8000, seed=0), HYPERFLEXIS_2TASK, 4000, 0.05
    )


def test_long_tail_has_a_heavier_tail_than_table1() -> None:
    long_tail = load_workload("long-tail", qps=50, requests=4000, seed=0)
    table1 = load_workload("hyperflexis-4task", qps=50, requests=4000, seed=0)

    def tail_ratio(rs: list[RequestSpec], task: str, field: str) -> float:
        values = [getattr(r, field) for r in rs if r.task == task]
        return _quantile(values, 0.99) / _quantile(values, 0.5)

    for field in ("prompt_tokens", "output_tokens"):
        assert tail_ratio(long_tail, "chat", field) > 8
        assert all(tail_ratio(table1, t.name, field) < 3 for t in HYPERFLEXIS_4TASK)
    assert (
        max(r.prompt_tokens for r in long_tail) <= 16384 and max(r.output_tokens for r in long_tail) <= 2048
    )


def test_multi_turn_turns_share_their_session_prefix_and_nothing_else() -> None:
    loaded = load_workload("multi-turn", qps=10, requests=600, seed=0)
    sessions: dict[str, list[RequestSpec]] = defaultdict(list)
    for r in loaded:
        assert r.session is not None
        sessions[r.session].append(r)
    assert sum(len(turns) >= 3 for turns in sessions.values()) > 20

    firsts: list[list[int]] = []
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))  # sorted by time = turn order
        ids = [prompt_token_ids(t) for t in turns]
        assert [len(i) for i in ids] == [t.prompt_tokens for t in turns]
        for (earlier, later), (e, lt) in zip(itertools.pairwise(turns), itertools.pairwise(ids), strict=True):
            # the later prompt repeats the earlier one, then its reply, then a new message
            assert lt[: len(e)] == e
            assert later.prompt_tokens > earlier.prompt_tokens + earlier.output_tokens
        firsts.append(ids[0])

    prefixes = {tuple(f[:512]) for f in firsts}
    assert 1 < len(prefixes) <= 4  # the four system prompts
    for a, b in itertools.combinations(firsts[:40], 2):
        # different sessions share the system prompt at most, never a user message (a token or
        # two may match by chance: 1 in 17,576 per position)
        shared = 512 if a[:512] == b[:512] else 0
        assert shared <= _common_prefix(a, b) <= shared + 2


def test_prompt_text_is_exactly_the_token_ids() -> None:
    spec = load_workload("multi-turn", qps=10, requests=40, seed=1)[-1]
    text = spec_prompt_text(spec)
    assert encode(text) == prompt_token_ids(spec) and len(text.split()) == spec.prompt_tokens
    legacy = RequestSpec(1.5, "t", 0, 37, 5, ttft_s=1.0, tpot_s=0.1)  # built without segments
    assert len(prompt_token_ids(legacy)) == 37 and prompt_token_ids(legacy) == prompt_token_ids(legacy)
    other = RequestSpec(2.5, "t", 0, 37, 5, ttft_s=1.0, tpot_s=0.1)
    assert prompt_token_ids(other) != prompt_token_ids(legacy)


def test_shared_task_prefix(tmp_path: Path) -> None:
    path = tmp_path / "prefixed.yaml"
    path.write_text(
        "tasks:\n  - {name: a, slo: {ttft_s: 1, tpot_s: 0.1}, prefix_tokens: 100, input: 20, output: 5}\n"
        "  - {name: b, slo: {ttft_s: 1, tpot_s: 0.1}, input: 20, output: 5}\n"
    )
    loaded = load_workload(str(path), qps=5, requests=40)
    a = [prompt_token_ids(r) for r in loaded if r.task == "a"]
    b = [prompt_token_ids(r) for r in loaded if r.task == "b"]
    assert all(len(x) == 120 and x[:100] == a[0][:100] and x[100:] != a[0][100:] for x in a[1:])
    assert all(len(x) == 20 for x in b) and _common_prefix(a[0], b[0]) < 3


def test_priority_ramp_levels_join_on_schedule() -> None:
    ramp = load_workload("priority-ramp", qps=60, seed=0)  # the paper's 15 QPS per client
    assert ramp[-1].at < 90
    for priority in range(4):
        times = [r.at for r in ramp if r.priority == priority]
        join = (3 - priority) * 20.0
        assert join <= min(times) < join + 1.0
        assert len(times) / (90 - join) == pytest.approx(15.0, rel=0.12)


def test_trace_arrivals_follow_the_file() -> None:
    path = workloads_dir() / "traces" / "mmpp-bursty.txt"
    raw = read_trace(path)
    assert 100 <= len(raw) <= 500
    trace = Trace.from_file(path)
    assert _cv(list(trace.intervals)) > 1.5  # the shipped trace is bursty
    rescaled = arrival_times(trace, random.Random(0), 10.0, count=3 * len(trace.intervals))
    assert len(rescaled) / rescaled[-1] == pytest.approx(10.0, rel=0.01)  # whole cycles: exact
    as_is = arrival_times(Trace.from_file(path, rescale=False), random.Random(0), 10.0, count=len(raw) - 1)
    assert as_is == pytest.approx([t - raw[0] for t in raw[1:]])


def test_every_shipped_workload_loads() -> None:
    assert set(list_workloads()) == SHIPPED
    for path in sorted(workloads_dir().glob("*.yaml")):
        loaded = load_workload(str(path), qps=5.0, requests=60, seed=1)
        assert len(loaded) == 60 and all(a.at <= b.at for a, b in itertools.pairwise(loaded)), path
        for r in loaded:
            assert r.prompt_tokens == sum(length for _, length in r.segments) >= 1 and r.output_tokens >= 1
        assert read_workload(path.stem).name == path.stem
    # without a size, the file's defaults apply
    assert len(load_workload("hyperflexis-4task", qps=10)) == 1200


_GOOD = """
kind: mix
arrivals: {process: gamma, cv: 2}
tasks:
  - name: a
    slo: {ttft_s: 1.0, tpot_s: 0.1}
    input: {dist: normal, mean: 50, std: 5}
    output: 10
"""


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("std: 5", "std: abc", "tasks[0].input.std"),
        ("std: 5", "std: -1", "tasks[0].input.std"),
        ("process: gamma, cv: 2", "process: weibull", "arrivals.process"),
        ("process: gamma, cv: 2", "process: gamma", "arrivals.cv"),
        ("process: gamma, cv: 2", "process: trace, path: nowhere.txt", "arrivals.path"),
        ("kind: mix", "kind: ramp", "ramp"),
        ("kind: mix", "kind: mixed", "kind"),
        ("ttft_s: 1.0", "ttft_s: 0", "tasks[0].slo.ttft_s"),
        ("tasks:", "taks:", "tasks"),
        ("    output: 10", "    outptu: 10", "tasks[0].output"),
        ("dist: normal", "dist: zipf", "tasks[0].input.dist"),
        ("  - name: a", "  - name: 7", "tasks[0].name"),
        # a misspelt optional field must not fall back to its default silently
        ("    output: 10", "    output: 10\n    priorty: 2", "tasks[0].priorty"),
        ("kind: mix", "kind: mix\ndefaults: {request: 5}", "defaults.request"),
    ],
)
def test_bad_spec_names_the_field(tmp_path: Path, old: str, new: str, field: str) -> None:
    assert old in _GOOD
    path = tmp_path / "bad.yaml"
    path.write_text(_GOOD.replace(old, new, 1))
    with pytest.raises(ValueError) as caught:
        load_workload(str(path), qps=1, requests=5)
    assert str(caught.value).startswith(f"{path}: {field}:"), str(caught.value)


def test_good_spec_and_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(_GOOD)
    assert len(load_workload(str(good), qps=1, requests=5)) == 5
    dup = tmp_path / "dup.yaml"
    dup.write_text(_GOOD + _GOOD.split("tasks:\n", 1)[1])
    with pytest.raises(ValueError, match=r"dup.yaml: tasks\[1\].name: duplicate"):
        load_workload(str(dup), qps=1, requests=5)
    broken = tmp_path / "broken.yaml"
    broken.write_text("tasks: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken\.yaml: not valid YAML"):
        load_workload(str(broken), qps=1, requests=5)
    with pytest.raises(ValueError, match=r"unknown workload 'no-such'.*hyperflexis-4task"):
        load_workload("no-such", qps=1, requests=5)
    with pytest.raises(ValueError, match="requests or duration_s"):
        load_workload(str(good), qps=1)
