"""SLO profiles and classification on literal profiles: resolution order, fallbacks, validation."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from policies.api import PolicyConfigError
from policies.priority_mapping import initial_state, observe_completion, set_pending
from policies.slo import (
    QueueLimits,
    SloHints,
    SloProfile,
    SloProfileError,
    SloSource,
    SloTarget,
    classify,
    classify_mapped,
    initial_priority_state,
    parse_slo_profile,
    slo_profile_from_mapping,
)

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "slo"

Q = {"max_queued": 8, "timeout_s": 1.0}
PROFILE: dict[str, Any] = {
    "name": "test",
    "default_class": "default",
    "classes": {
        "chat": {"ttft_s": 0.5, "tpot_s": 0.05, "queue": Q},
        "batch": {"ttft_s": 10.0, "tpot_s": 0.5, "queue": Q},
        "default": {"ttft_s": 2.0, "tpot_s": 0.2, "queue": Q},
    },
    "tenants": {"acme": "batch"},
    "priority": {
        "window": 10,
        "levels": [
            {"name": "p0", "ttft_s": [0.2, 0.6], "tpot_s": [0.02, 0.06], "queue": Q},
            {
                "name": "p1",
                "ttft_s": [1.0, 3.0],
                "tpot_s": [0.1, 0.3],
                "queue": {"max_queued": 2, "timeout_s": 9},
            },
        ],
    },
}
WITH_PRIORITY = slo_profile_from_mapping(PROFILE)
WITHOUT_PRIORITY = slo_profile_from_mapping({k: v for k, v in PROFILE.items() if k != "priority"})

E, T, P, N, D = SloSource.EXPLICIT, SloSource.TASK, SloSource.PRIORITY, SloSource.TENANT, SloSource.DEFAULT


@pytest.mark.parametrize(
    ("hints", "expected"),
    [
        # 1. explicit targets win; the class still comes from the rest of the chain
        (SloHints(ttft_ms=300, tpot_ms=40, task="batch"), SloTarget(0.3, 0.04, "batch", E)),
        (SloHints(ttft_ms=300, tpot_ms=40), SloTarget(0.3, 0.04, "default", E)),
        (SloHints(ttft_ms=300, tpot_ms=40, priority=1), SloTarget(0.3, 0.04, "p1", E)),
        # partial explicit: the missing field falls back to the next source
        (SloHints(ttft_ms=300, task="chat"), SloTarget(0.3, 0.05, "chat", E, T)),
        (SloHints(tpot_ms=40, tenant="acme"), SloTarget(10.0, 0.04, "batch", N, E)),
        (SloHints(tpot_ms=40), SloTarget(2.0, 0.04, "default", D, E)),
        (SloHints(ttft_ms=300, priority=0), SloTarget(0.3, 0.04, "p0", E, P)),
        # unusable explicit values count as absent
        (SloHints(ttft_ms=0, tpot_ms=-5, task="chat"), SloTarget(0.5, 0.05, "chat", T)),
        (SloHints(ttft_ms=math.nan, tpot_ms=math.inf, task="chat"), SloTarget(0.5, 0.05, "chat", T)),
        # positive in milliseconds, nothing in seconds (5e-324 ms held its worker, a target of 0 s)
        (SloHints(ttft_ms=5e-324, tpot_ms=5e-324, task="chat"), SloTarget(0.5, 0.05, "chat", T)),
        # 2. task beats priority and tenant
        (SloHints(task="chat", priority=1, tenant="acme"), SloTarget(0.5, 0.05, "chat", T)),
        # unknown task falls through
        (SloHints(task="nope", priority=1), SloTarget(2.0, 0.2, "p1", P)),
        # 3. priority (static: range midpoint) beats tenant; out-of-range priorities are clamped
        (SloHints(priority=0, tenant="acme"), SloTarget(0.4, 0.04, "p0", P)),
        (SloHints(priority=9), SloTarget(2.0, 0.2, "p1", P)),
        (SloHints(priority=-3), SloTarget(0.4, 0.04, "p0", P)),
        # 4. tenant default
        (SloHints(tenant="acme"), SloTarget(10.0, 0.5, "batch", N)),
        (SloHints(task="nope", tenant="acme"), SloTarget(10.0, 0.5, "batch", N)),
        # 5. profile default
        (SloHints(tenant="other"), SloTarget(2.0, 0.2, "default", D)),
        (SloHints(), SloTarget(2.0, 0.2, "default", D)),
    ],
)
def test_resolution_order(hints: SloHints, expected: SloTarget) -> None:
    got = classify(hints, WITH_PRIORITY)
    assert got.slo_class == expected.slo_class
    assert (got.source, got.tpot_source) == (expected.source, expected.tpot_source)
    assert (got.ttft_s, got.tpot_s) == pytest.approx((expected.ttft_s, expected.tpot_s))


def test_priority_is_ignored_without_priority_levels() -> None:
    assert classify(SloHints(priority=0, tenant="acme"), WITHOUT_PRIORITY) == SloTarget(10.0, 0.5, "batch", N)
    assert classify(SloHints(priority=0), WITHOUT_PRIORITY).slo_class == "default"


def test_classify_mapped_uses_algorithm_2_for_the_priority_step() -> None:
    assert WITH_PRIORITY.priority is not None
    state = initial_state(WITH_PRIORITY.priority.mapping_config())
    for ttft, queue in ((0.25, 0.0), (0.5, 0.1), (0.3, 0.0)):
        state = observe_completion(state, 0, ttft, 0.03, queue)
    # N = 2, C_0 = 3: index floor(1/3 * 3) = 1 -> sorted TTFT [0.25, 0.3, 0.5][1]
    target, after = classify_mapped(SloHints(priority=0), WITH_PRIORITY, state)
    assert target == SloTarget(0.3, 0.03, "p0", P)
    assert after.last_queue_time == (0.0, None)

    # p1 with no p1 history reads past p0's share; uncontended, its floor relaxes to p0's
    target, _ = classify_mapped(SloHints(priority=1), WITH_PRIORITY, after)
    assert target == SloTarget(0.5, 0.03, "p1", P)
    target, _ = classify_mapped(SloHints(priority=1), WITH_PRIORITY, set_pending(after, [1, 0]))
    assert target == SloTarget(1.0, 0.1, "p1", P)  # p0 waiting: p1's strict floor


@pytest.mark.parametrize(
    "hints",
    [
        SloHints(task="chat", priority=0),
        SloHints(ttft_ms=100, tpot_ms=10, priority=0),
        SloHints(tenant="acme"),
    ],
)
def test_classify_mapped_leaves_state_alone_when_the_mapper_is_not_used(hints: SloHints) -> None:
    assert WITH_PRIORITY.priority is not None
    state = observe_completion(initial_state(WITH_PRIORITY.priority.mapping_config()), 0, 0.3, 0.03, 0.2)
    _, after = classify_mapped(hints, WITH_PRIORITY, state)
    assert after is state


def test_initial_priority_state() -> None:
    assert initial_priority_state(WITHOUT_PRIORITY) is None
    state = initial_priority_state(WITH_PRIORITY)
    assert state is not None and state.config.window == 10 and state.counts == (0, 0)


def test_queue_limits_by_class_name() -> None:
    assert WITH_PRIORITY.queue_limits("chat") == QueueLimits(max_queued=8, timeout_s=1.0)
    assert WITH_PRIORITY.queue_limits("p1") == QueueLimits(max_queued=2, timeout_s=9.0)
    with pytest.raises(KeyError):
        WITH_PRIORITY.queue_limits("nope")


@pytest.mark.parametrize(
    ("profile", "tightest"),
    [
        (WITHOUT_PRIORITY, 0.5),  # the "chat" class
        (WITH_PRIORITY, 0.2),  # p0's floor: the mapper can assign down to it
        (
            slo_profile_from_mapping(
                {
                    **PROFILE,
                    "priority": {
                        **PROFILE["priority"],
                        "levels": [{"name": "p0", "ttft_s": [0.9, 1.0], "tpot_s": [0.1, 0.2], "queue": Q}],
                    },
                }
            ),
            0.5,
        ),
    ],
)
def test_tightest_ttft_counts_classes_and_priority_floors(profile: SloProfile, tightest: float) -> None:
    assert profile.tightest_ttft_s == tightest


def mutate(path: str, value: Any) -> dict[str, Any]:
    """A copy of PROFILE with ``path`` (dotted, list indexes allowed) set, or deleted if value is DEL."""
    data = copy.deepcopy(PROFILE)
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) else last
    if value is DEL:
        del node[key]
    else:
        node[key] = value
    return data


DEL = object()


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("classes.chat.ttft_s", -1, "classes.chat.ttft_s: Input should be greater than 0"),
        ("classes.chat.tpot_s", "fast", "classes.chat.tpot_s: Input should be a valid number"),
        ("classes.chat.queue", DEL, "classes.chat.queue: Field required"),
        (
            "classes.chat.queue.max_queued",
            0,
            "classes.chat.queue.max_queued: Input should be greater than or equal to 1",
        ),
        (
            "classes.chat.queue.timeout_s",
            math.inf,
            "classes.chat.queue.timeout_s: Input should be a finite number",
        ),
        ("classes.chat.ttft", 1.0, "classes.chat.ttft: Extra inputs are not permitted"),
        ("classes", {}, "classes: Dictionary should have at least 1 item"),
        ("default_class", "nope", "default_class: 'nope' is not in classes (defined: batch, chat, default)"),
        ("tenants.acme", "nope", "tenants.acme: class 'nope' is not in classes"),
        ("priority.window", 0, "priority.window: Input should be greater than or equal to 1"),
        ("priority.levels", [], "priority.levels: Tuple should have at least 1 item"),
        (
            "priority.levels.0.ttft_s",
            [2.0, 1.0],
            "priority.levels.0.ttft_s: range must be [min, max] with min <= max",
        ),
        ("priority.levels.1.tpot_s", [0.1], "priority.levels.1.tpot_s.1: Field required"),
        ("priority.levels.1.tpot_s", [0.1, 0], "priority.levels.1.tpot_s.1: Input should be greater than 0"),
        ("priority.levels.1.name", "chat", "priority.levels.1.name: 'chat' is already used"),
        ("priority.levels.1.name", "p0", "priority.levels.1.name: 'p0' is already used"),
        ("version", 2, "version: Input should be 1"),
        ("nmae", "typo", "nmae: Extra inputs are not permitted"),
    ],
)
def test_validation_errors_name_the_key(path: str, value: Any, expected: str) -> None:
    with pytest.raises(SloProfileError) as info:
        slo_profile_from_mapping(mutate(path, value), "profiles/slo/bad.yaml")
    message = str(info.value)
    assert message.startswith("profiles/slo/bad.yaml: invalid SLO profile")
    assert expected in message


def test_every_error_is_reported_at_once() -> None:
    data = mutate("classes.chat.ttft_s", -1)
    data["classes"]["batch"]["tpot_s"] = 0
    with pytest.raises(SloProfileError) as info:
        slo_profile_from_mapping(data)
    assert "classes.chat.ttft_s" in str(info.value) and "classes.batch.tpot_s" in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: [unclosed", "x.yaml: not valid YAML"),
        ("- a\n- b\n", "x.yaml: an SLO profile must be a mapping, got list"),
        ("", "x.yaml: an SLO profile must be a mapping, got NoneType"),
        ("name: x\nclasses: {}\n", "default_class: Field required"),
    ],
)
def test_parse_errors(text: str, expected: str) -> None:
    with pytest.raises(SloProfileError, match=None) as info:
        parse_slo_profile(text, "x.yaml")
    assert expected in str(info.value)
    assert isinstance(info.value, PolicyConfigError)


def load(name: str) -> SloProfile:
    path = PROFILES / f"{name}.yaml"
    return parse_slo_profile(path.read_text(), str(path))


@pytest.mark.parametrize(
    ("profile", "task", "ttft", "tpot"),
    [
        # HyperFlexis Table 1
        ("hyperflexis-4task", "medical_qa", 0.7, 0.5),
        ("hyperflexis-4task", "tldr_content_gen", 1.0, 0.7),
        ("hyperflexis-4task", "tldr_headline_gen", 2.0, 0.9),
        ("hyperflexis-4task", "wikisql", 20.0, 1.0),
        ("hyperflexis-4task", "default", 1.5, 0.8),
        ("hyperflexis-2task", "gsm8k", 0.7, 0.2),
        ("hyperflexis-2task", "sharegpt", 2.0, 0.5),
        ("hyperflexis-2task", "default", 1.35, 0.35),
    ],
)
def test_shipped_task_profiles(profile: str, task: str, ttft: float, tpot: float) -> None:
    target = classify(SloHints(task=task), load(profile))
    assert (target.ttft_s, target.tpot_s, target.slo_class) == (ttft, tpot, task)


@pytest.mark.parametrize(
    ("priority", "ttft", "tpot"),
    [(0, 0.7, 0.5), (1, 1.0, 0.7), (2, 2.0, 0.9), (3, 20.0, 1.0)],
)
def test_shipped_priority_profile_is_table1_plus_minus_25_percent(
    priority: int, ttft: float, tpot: float
) -> None:
    profile = load("priority")
    assert profile.priority is not None
    level = profile.priority.levels[priority]
    assert level.ttft_s == pytest.approx((0.75 * ttft, 1.25 * ttft))
    assert level.tpot_s == pytest.approx((0.75 * tpot, 1.25 * tpot))
    target = classify(SloHints(priority=priority), profile)
    assert (target.ttft_s, target.tpot_s) == pytest.approx((ttft, tpot))


TASKS_4 = {
    "medical_qa": (0.7, 0.5),
    "tldr_content_gen": (1.0, 0.7),
    "tldr_headline_gen": (2.0, 0.9),
    "wikisql": (20.0, 1.0),
}


def test_default_profile_maps_priorities_like_the_priority_profile() -> None:
    default, priority = load("hyperflexis-4task"), load("priority")
    assert default.priority is not None and default.priority == priority.priority


@pytest.mark.parametrize("priority", [None, 0, 3])
@pytest.mark.parametrize("task", sorted(TASKS_4))
def test_default_profile_gives_a_named_task_its_class_whatever_the_priority(
    task: str, priority: int | None
) -> None:
    """What Experiment A relies on: task-named requests keep Table 1 targets and their class."""
    profile = load("hyperflexis-4task")
    hints = SloHints(task=task, priority=priority)
    assert classify(hints, profile) == SloTarget(*TASKS_4[task], task, T)
    state = initial_priority_state(profile)
    assert state is not None
    state = observe_completion(state, 0, 0.2, 0.05, 0.0)
    target, after = classify_mapped(hints, profile, state)
    assert target == SloTarget(*TASKS_4[task], task, T)
    assert after is state  # the mapper did not run: its per-level queue-time memory is untouched


def test_default_profile_explicit_targets_with_a_task_keep_the_task_class() -> None:
    # Experiment A sends x-slo-task, scaled x-slo-ttft-ms / x-slo-tpot-ms and x-priority: 0
    profile = load("hyperflexis-4task")
    state = initial_priority_state(profile)
    assert state is not None
    hints = SloHints(ttft_ms=350, tpot_ms=250, task="medical_qa", priority=0)
    target, after = classify_mapped(hints, profile, state)
    assert target == SloTarget(0.35, 0.25, "medical_qa", E)
    assert after is state


@pytest.mark.parametrize(
    ("priority", "level", "ttft", "tpot"),
    [
        (0, "p0", 0.7, 0.5),
        (1, "p1", 1.0, 0.7),
        (2, "p2", 2.0, 0.9),
        (3, "p3", 20.0, 1.0),
        (8, "p3", 20.0, 1.0),
    ],
)
def test_default_profile_maps_a_bare_priority_to_its_level(
    priority: int, level: str, ttft: float, tpot: float
) -> None:
    profile = load("hyperflexis-4task")
    # static: the level's range midpoint, the Table 1 target it was built around
    target = classify(SloHints(priority=priority), profile)
    assert (target.slo_class, target.source) == (level, P)
    assert (target.ttft_s, target.tpot_s) == pytest.approx((ttft, tpot))
    # mapped with an empty window: the same midpoint
    state = initial_priority_state(profile)
    assert state is not None
    mapped, _ = classify_mapped(SloHints(priority=priority), profile, state)
    assert mapped == target


def test_default_profile_separates_priorities_and_leaves_the_rest_default() -> None:
    profile = load("hyperflexis-4task")
    state = initial_priority_state(profile)
    assert state is not None and state.config.num_levels == 4 and state.config.window == 500
    # one fast P0 completion in the window: eq.(6) reads it for both levels, then each clamps
    state = observe_completion(state, 0, 0.3, 0.1, 0.0)
    p0, state = classify_mapped(SloHints(priority=0), profile, state)
    p3, state = classify_mapped(SloHints(priority=3), profile, state)
    assert p0 == SloTarget(0.525, 0.375, "p0", P)  # p0's floors
    assert p3 == SloTarget(0.525, 0.375, "p3", P)  # nothing above waits: relaxed to p0's floors
    p3_contended, _ = classify_mapped(SloHints(priority=3), profile, set_pending(state, {0: 1}))
    assert p3_contended == SloTarget(15.0, 0.75, "p3", P)  # P0 waiting: p3's own floors
    assert profile.queue_limits("p3") == QueueLimits(max_queued=512, timeout_s=100.0)
    for hints in (SloHints(), SloHints(task="no-such-task"), SloHints(tenant="anyone")):
        assert classify_mapped(hints, profile, state) == (SloTarget(1.5, 0.8, "default", D), state)


def test_default_profile_tightest_ttft_is_p0s_floor() -> None:
    # medical_qa's 0.7 s was the tightest before the levels; Algorithm 2 can assign p0's 0.525 s
    assert load("hyperflexis-4task").tightest_ttft_s == 0.525
    assert load("hyperflexis-2task").tightest_ttft_s == 0.7  # classes only: gsm8k


def test_every_shipped_profile_validates() -> None:
    names = sorted(p.stem for p in PROFILES.glob("*.yaml"))
    assert {"hyperflexis-4task", "hyperflexis-2task", "priority"} <= set(names)
    for name in names:
        load(name)


def test_class_ttft_is_the_class_target_or_a_levels_upper_bound() -> None:
    from profiles import PROFILES_DIR

    profile = parse_slo_profile((PROFILES_DIR / "slo" / "hyperflexis-4task.yaml").read_text(), "4task")
    assert profile.class_ttft_s("medical_qa") == 0.7
    assert profile.class_ttft_s("p3") == 25.0
    assert profile.class_ttft_s("nope") is None
