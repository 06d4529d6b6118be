"""SLO outcome accounting: every request counted once with its outcome; each objective judged on its own."""

from __future__ import annotations

import pytest

from gateway import metrics
from gateway.api.request_parse import parse_request
from gateway.dispatch.core import ClassLimits
from gateway.dispatch.slo_service import SloService
from gateway.serving.call import Call
from gateway.settings import load_settings
from policies.slo import SloSource, SloTarget

TARGET = SloTarget(ttft_s=1.0, tpot_s=0.1, slo_class="acct-test", source=SloSource.TASK)
OUTCOMES = ("met", "missed_ttft", "missed_tpot", "missed_latency", "rejected", "error", "cancelled")


async def _noop(_: object) -> None:
    return None


def make_call(
    stream: bool, ttft_s: float | None = None, tpot_s: float | None = None, tokens: int = 5
) -> Call:
    body = b'{"model":"m","prompt":"hi","max_tokens":50%s}' % (b',"stream":true' if stream else b"")
    call = Call(parse_request("completions", body, 16), "sg-1", "c-1", 100.0, _noop, TARGET, None, (), {})
    call.engine_id = "e0"
    if ttft_s is not None:
        call.first_at = 100.0 + ttft_s
        call.content_events = tokens
        call.last_at = call.first_at + (tpot_s or 0.0) * (tokens - 1)
        call.finished_at = call.last_at
    return call


def requests_counted() -> dict[str, float]:
    return {
        o: metrics.REGISTRY.get_sample_value(
            "slogate_slo_requests_total", {"slo_class": "acct-test", "outcome": o}
        )
        or 0.0
        for o in OUTCOMES
    }


def objective(name: str, result: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "slogate_slo_outcomes_total", {"slo_class": "acct-test", "objective": name, "outcome": result}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("call", "status", "expected"),
    [
        (make_call(True, 0.5, 0.05), 200, "met"),
        (make_call(True, 2.0, 0.05), 200, "missed_ttft"),
        (make_call(True, 0.5, 0.20), 200, "missed_tpot"),
        (make_call(True, 0.5, None, tokens=1), 200, "met"),  # one token: no inter-token time to miss
        (make_call(True), 200, "error"),  # headers sent but no event ever came
        (make_call(True), 429, "rejected"),
        (make_call(True), 503, "rejected"),
        (make_call(True), 502, "error"),
        (make_call(True), 504, "error"),
        (make_call(True), 499, "cancelled"),
        (make_call(False), 400, None),  # the client's mistake is no SLO miss
        (make_call(False), 404, None),
        (make_call(False), 422, None),
    ],
)
def test_every_request_is_counted_once_with_its_outcome(
    call: Call, status: int, expected: str | None
) -> None:
    slo = SloService(load_settings(None))
    before = requests_counted()
    assert slo.account(call, status) == expected
    after = requests_counted()
    changed = {o for o in OUTCOMES if after[o] != before[o]}
    assert changed == ({expected} if expected else set())
    if expected:
        assert after[expected] == before[expected] + 1


def test_non_streamed_requests_are_judged_by_end_to_end_latency() -> None:
    slo = SloService(load_settings(None))
    # 10 tokens may take TTFT + 9 x TPOT = 1.9 s
    fast = make_call(False)
    fast.completion_tokens, fast.finished_at = 10, 101.8
    slow = make_call(False)
    slow.completion_tokens, slow.finished_at = 10, 102.0
    assert slo.account(fast, 200) == "met"
    assert slo.account(slow, 200) == "missed_latency"


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "met"),
    [
        (0.5, 0.05, {"ttft", "tpot", "both"}),
        (2.0, 0.05, {"tpot"}),  # late first token, steady stream: TPOT met, TTFT and both missed
        (0.5, 0.20, {"ttft"}),
    ],
)
def test_each_objective_is_judged_on_its_own(ttft_s: float, tpot_s: float, met: set[str]) -> None:
    slo = SloService(load_settings(None))
    before = {(o, r): objective(o, r) for o in ("ttft", "tpot", "both") for r in ("met", "missed")}
    slo.account(make_call(True, ttft_s, tpot_s), 200)
    for name in ("ttft", "tpot", "both"):
        result = "met" if name in met else "missed"
        assert objective(name, result) == before[(name, result)] + 1, name
        other = "missed" if result == "met" else "met"
        assert objective(name, other) == before[(name, other)], name


def test_class_limits_come_from_the_profile_and_only_its_classes_are_kept() -> None:
    """Read on every arrival: made once per profile class, while an unknown class (defaults)
    adds nothing that a client naming endless classes could grow."""
    slo = SloService(load_settings(slo_profile="hyperflexis-2task"))
    gsm8k = slo.class_limits("gsm8k")
    assert (gsm8k.max_queued, gsm8k.queue_timeout_s, gsm8k.class_ttft_s) == (512, 3.5, 0.7)
    assert slo.class_limits("gsm8k") is gsm8k
    assert slo.class_limits("sharegpt").queue_timeout_s == 10.0
    for i in range(100):
        assert slo.class_limits(f"unknown-{i}") == ClassLimits()
    assert set(slo._limits) == {"gsm8k", "sharegpt"}


@pytest.mark.parametrize("routing", ["least-load", "hyperflexis"])
def test_a_queue_for_the_model_ends_the_mappers_relaxed_floor(routing: str) -> None:
    """The priority mapper gives a lone low priority targets as tight as priority 0's only while
    nothing waits for an engine of its model, and for BACKLOG_MEMORY_S after a wait ended."""
    from gateway.dispatch.build import RoutingProfile, build_core
    from gateway.dispatch.core import BACKLOG_MEMORY_S
    from gateway.dispatch.offline import offline_fleet
    from gateway.fleet.registry import RunningEntry
    from policies.api import RequestView
    from policies.priority_mapping import observe_completion

    settings = load_settings(slo_profile="hyperflexis-4task", routing_profile=routing, max_engine_load=1)
    slo = SloService(settings)
    assert slo.mapping is not None
    slo.mapping = observe_completion(slo.mapping, 3, 0.3, 0.05, 0.0)  # answered fast so far
    fleet = offline_fleet({"m": 1, "other": 1})
    core = build_core(settings, fleet, slo, RoutingProfile.load(settings.routing_profile_path()))
    now = 0.0
    slo.attach(fleet, lambda: now, 0.0)
    p3 = {b"x-priority": b"3"}

    def ttft(model: str = "m") -> float:
        return slo.classify(p3, None, model=model)[0].ttft_s

    def submit(rid: str) -> object:
        view = RequestView(rid, "m", 100, 10, arrival=now, priority=3)
        return core.submit(core.ticket(view, 20.0, 1.0, "p3", RunningEntry(100, 10, 1.0, now), now), now)

    assert ttft() == 0.525  # nothing waits: relaxed to p0's floor
    assert submit("r-1") is not None and submit("r-2") is None  # r-2 waits
    assert ttft() == 15.0 and ttft("other") == 0.525  # p3's own floor, for this model only
    now = 5.0  # r-2 waits for longer than the memory, then leaves the queue for the engine
    fleet.release("m-0", "r-1")
    core.step(now)
    assert [rid for rid, _ in core.outbox] == ["r-2"] and core.queued("m") == 0
    now += BACKLOG_MEMORY_S / 2
    assert ttft() == 15.0  # the queue emptied, but only just
    now += BACKLOG_MEMORY_S
    assert ttft() == 0.525


@pytest.mark.parametrize(
    ("extra", "choices"),
    [(b',"n":4', 4), (b',"n":4.0', 4), (b',"prompt":["a","b"]', 2), (b',"n":2,"prompt":["a","b","c"]', 6)],
)
def test_a_stream_of_several_choices_is_judged_per_engine_step(extra: bytes, choices: int) -> None:
    """Each engine step sends an event per choice: counted as events, a stream of four choices
    at 0.12 s a token read 0.03 s and met a 0.1 s TPOT it missed. (Without per-choice counts,
    as when the relay could not read them, the steps are the events over the choices.)"""
    body = b'{"model":"m","prompt":"hi","max_tokens":50,"stream":true%s}' % extra
    body = body.replace(b'"prompt":"hi",', b"") if b'"prompt":[' in extra else body
    call = Call(parse_request("completions", body, 16), "sg-1", "c-1", 100.0, _noop, TARGET, None, (), {})
    call.engine_id = "e0"
    steps = 10
    call.first_at, call.content_events = 100.5, steps * choices
    call.last_at = call.first_at + 0.12 * (steps - 1)
    assert call.request.choices == choices
    assert call.tpot_s == pytest.approx(0.12)
    assert SloService(load_settings(None)).account(call, 200) == "missed_tpot"


def test_choices_of_unequal_length_are_judged_by_the_longest() -> None:
    """Two choices, one of 10 tokens and one of 100, at 0.06 s a step: 110 events over 99 steps.
    Events over choices read 55 steps, a TPOT of 0.11 s (missed) for a stream at 0.06 s."""
    body = b'{"model":"m","prompt":"hi","max_tokens":100,"stream":true,"n":2}'
    call = Call(parse_request("completions", body, 16), "sg-1", "c-1", 100.0, _noop, TARGET, None, (), {})
    call.engine_id = "e0"
    call.first_at, call.content_events = 100.5, 110
    call.last_at = call.first_at + 0.06 * 99
    call.choice_events = {0: 10, 1: 100}
    assert call.tpot_s == pytest.approx(0.06)
    assert SloService(load_settings(None)).account(call, 200) == "met"


def test_a_non_streamed_answer_of_several_choices_is_allowed_one_choice_s_time() -> None:
    """The choices are generated side by side; the allowance counted the tokens of all of them:
    n = 4 of 10 tokens each was allowed 39 steps, and an answer four times too slow was met."""
    slo = SloService(load_settings(None))
    body = b'{"model":"m","prompt":"hi","max_tokens":10,"n":4}'
    call = Call(parse_request("completions", body, 16), "sg-1", "c-1", 100.0, _noop, TARGET, None, (), {})
    call.engine_id = "e0"
    # 40 tokens in all, 10 a choice at most (max_tokens): TTFT + 9 x TPOT = 1.9 s
    call.completion_tokens, call.finished_at = 40, 102.5
    assert slo.account(call, 200) == "missed_latency"
    call.finished_at = 101.8
    assert slo.account(call, 200) == "met"
    # choices of unequal length (sampling): 13 tokens in all may be one of 10 and three of 1,
    # and the answer takes as long as its longest; judged so, as a stream of them is
    call.completion_tokens, call.finished_at = 13, 101.8
    assert slo.account(call, 200) == "met"


def test_a_request_refused_anyway_does_not_move_the_priority_mapper() -> None:
    """The mapper's spike correction reads the reference queue time of the last request it
    assigned at a level: one for a model nobody serves (classified only so that a bad SLO header
    is still its error) must not stand in for it, or unknown-model requests would hide spikes."""
    from policies.priority_mapping import observe_completion

    slo = SloService(load_settings(slo_profile="hyperflexis-4task"))
    assert slo.mapping is not None
    slo.mapping = observe_completion(slo.mapping, 1, 0.3, 0.05, 0.2)
    before = slo.mapping
    p1 = {b"x-priority": b"1"}
    refused = slo.classify(p1, None, model="nobody-serves-this", record=False)[0]
    assert slo.mapping is before
    served = slo.classify(p1, None, model="m")[0]
    assert served == refused  # the same answer: only what it remembers differs
    assert slo.mapping is not before and slo.mapping.last_queue_time[1] == 0.2


def test_a_decode_engine_with_no_samples_is_judged_by_its_pool_s_learnt_model() -> None:
    """The decode stage judged a fresh engine by its prior: a pessimistic one left it never
    chosen while another was feasible, so it never learnt. Until it has samples of its own it is
    judged by the pool's fastest learnt model (the live flow and the simulator alike)."""
    from policies.latency_fit import MIN_SAMPLES, DecodeSample

    engines = [{"url": f"http://127.0.0.1:{9000 + i}", "model": "m", "name": f"d{i}"} for i in range(2)]
    slo = SloService(load_settings(None, engines=engines))
    truth = (0.004, 2e-7, 5e-4)
    steps = [
        DecodeSample(c, b, truth[0] + truth[1] * c + truth[2] * b)
        for b in (1, 4, 16)
        for c in (500, 5000, 20000)
    ]
    slo.latency.add_samples("d0", steps[: max(MIN_SAMPLES, 9)])
    learnt = slo.coefficients("d0")[1]
    assert learnt != slo.coefficients("d1")[1]
    judged = slo.decode_judged(["d0", "d1"], 1000)
    assert (judged["d1"].a_d, judged["d1"].b_d, judged["d1"].c_d) == learnt
    assert (judged["d0"].a_d, judged["d0"].b_d, judged["d0"].c_d) == learnt
    assert (judged["d1"].a, judged["d1"].b, judged["d1"].c) == slo.coefficients("d1")[
        0
    ]  # (its prefill: its own)
