"""The latency learner's mechanism on a live-like clock: tokens grouped into engine steps by their
arrival times, the steps described to the policy, samples held until the engine's counters confirm
them (or kept at once for an engine with no metrics)."""

from __future__ import annotations

import pytest

from gateway.dispatch.latency_learner import DECODE_PER_INTERVAL, LatencyLearner
from gateway.dispatch.offline import fleet_of
from gateway.fleet.registry import Fleet, RunningEntry
from gateway.settings import EngineConfig
from policies.api import EngineState, EngineTiming
from policies.latency_fit import Coeffs, DecodeSample, PrefillSample

PRIOR: tuple[Coeffs, Coeffs] = ((0.02, 1e-4, 0.0), (0.01, 1e-7, 1e-4))
GAP = 0.001


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(kind: str = "sim") -> tuple[Fleet, LatencyLearner, Clock]:
    config = EngineConfig(url="http://127.0.0.1:9", kind=kind, model="m", name="e")  # type: ignore[arg-type]
    fleet = fleet_of([config], 3.0)
    learner = LatencyLearner({"e": PRIOR})
    clock = Clock()
    learner.attach(fleet, clock, GAP)
    return fleet, learner, clock


def send(fleet: Fleet, clock: Clock, rid: str, prompt: int) -> RunningEntry:
    entry = RunningEntry(prompt, 100, 0.1, 0.0)
    fleet.reserve("e", rid, entry)
    entry.dispatched_at = clock.now
    return entry


def token(fleet: Fleet, rid: str) -> None:
    record = fleet.records["e"]
    entry = record.running[rid]
    if not entry.prefilled:
        fleet.mark_prefilled("e", rid)
    fleet.add_generated(record, entry, 1)


def step(fleet: Fleet, clock: Clock, seconds: float, rids: list[str], jitter: float = 0.0002) -> None:
    """One engine step of ``seconds``: its tokens reach the gateway ``jitter`` apart (live)."""
    clock.now += seconds
    start = clock.now
    for i, rid in enumerate(rids):
        clock.now = start + i * jitter
        token(fleet, rid)
    clock.now = start


def pending(learner: LatencyLearner) -> tuple[list[PrefillSample], list[DecodeSample]]:
    steps = learner._steps["e"]
    return list(steps.pending_prefill), list(steps.pending_decode)


def test_tokens_that_arrive_together_are_one_step_and_clean_steps_become_samples() -> None:
    fleet, learner, clock = setup()
    send(fleet, clock, "a", 300)
    step(fleet, clock, 0.05, ["a"])  # the engine was idle: a's prefill, from its send
    send(fleet, clock, "b", 100)  # sent while a decodes: b joins the next step
    step(fleet, clock, 0.03, ["a", "b"])  # a decodes, b's prompt completes
    step(fleet, clock, 0.012, ["b", "a"])  # both decode
    step(fleet, clock, 0.012, ["a", "b"])  # (closes the step before)
    prefill, decode = pending(learner)
    assert prefill == [
        PrefillSample((300,), pytest.approx(0.05)),
        PrefillSample((100,), pytest.approx(0.03), 301, 1),
    ]
    assert decode == [DecodeSample(301 + 1 + 101, 2, pytest.approx(0.012))]


def test_a_burst_spread_over_the_step_or_missing_a_decoder_is_no_sample() -> None:
    """Nor is the step after it: its start, the broken burst's time, is not a step boundary."""
    fleet, learner, clock = setup()
    for rid in "abcd":
        send(fleet, clock, rid, 50)
    step(fleet, clock, 0.05, list("abcd"))
    # the gateway lagged: the four tokens came 0.9 ms apart each, 2.7 ms of a 10 ms step
    step(fleet, clock, 0.01, list("abcd"), jitter=0.0009)
    step(fleet, clock, 0.01, list("abcd"))  # its start is the lagging burst's: unknown
    step(fleet, clock, 0.01, list("abc"))  # d's token is missing: not a whole step
    step(fleet, clock, 0.01, list("abcd"))  # after a broken one
    step(fleet, clock, 0.011, list("abcd"))  # a sample
    step(fleet, clock, 0.01, list("abcd"))  # (closes the one before)
    prefill, decode = pending(learner)
    assert len(prefill) == 1 and [s.seconds for s in decode] == [pytest.approx(0.011)]
    assert learner._steps["e"].unclean == 4


def test_a_prompt_still_pending_spoils_the_steps_it_may_have_shared() -> None:
    fleet, learner, clock = setup()
    send(fleet, clock, "a", 50)
    step(fleet, clock, 0.02, ["a"])
    send(fleet, clock, "long", 5000)  # chunked: its first token comes three steps later
    step(fleet, clock, 0.2, ["a"])
    step(fleet, clock, 0.2, ["a"])
    step(fleet, clock, 0.2, ["a", "long"])
    step(fleet, clock, 0.012, ["a", "long"])
    step(fleet, clock, 0.012, ["a", "long"])
    prefill, decode = pending(learner)
    # a's own prefill, then one clean decode step; the chunk steps and the last chunk are not samples
    assert [s.input_lengths for s in prefill] == [(50,)]
    assert len(decode) == 1 and decode[0].batch_size == 2


def timing(steps: float, generated: float) -> EngineState:
    return EngineState(timing=EngineTiming(steps=steps, generation_tokens=generated, preemptions=0.0))


def test_samples_wait_for_the_engines_counters_and_are_dropped_when_they_disagree() -> None:
    fleet, learner, clock = setup()
    fleet.record_state("e", timing(0, 0), clock.now)  # the baseline
    send(fleet, clock, "a", 64)
    for _ in range(20):
        step(fleet, clock, 0.01, ["a"])
    assert learner.sample_counts("e") == (0, 0)
    fleet.record_state("e", timing(20, 20), clock.now)  # the engine agrees: 20 steps, 20 tokens
    # a's prefill, and of its 18 clean decode steps the interval's latest DECODE_PER_INTERVAL
    assert learner.sample_counts("e") == (1, DECODE_PER_INTERVAL)
    for _ in range(20):
        step(fleet, clock, 0.01, ["a"])
    fleet.record_state("e", timing(60, 80), clock.now)  # 20 steps and 40 tokens it did not show
    assert learner.sample_counts("e") == (1, DECODE_PER_INTERVAL)
    assert pending(learner) == ([], [])


def test_an_engine_without_metrics_keeps_its_samples_at_once_and_is_refitted() -> None:
    fleet, learner, clock = setup("openai")
    send(fleet, clock, "a", 64)
    for _ in range(12):
        step(fleet, clock, 0.03, ["a"])  # decode steps 3x the prior's
    assert learner.sample_counts("e") == (1, 10)
    _, decode = learner.coefficients("e") or PRIOR
    assert decode[0] + decode[1] * 70 + decode[2] == pytest.approx(0.03, rel=1e-3)


def test_a_full_engine_is_refitted_at_most_every_ten_seconds() -> None:
    from gateway.dispatch import latency_learner as module
    from policies.latency_fit import DecodeSample

    learner = module.LatencyLearner({"e": ((0.02, 1e-4, 0.0), (0.01, 1e-8, 1e-4))}, capacity=64)
    now = [0.0]
    learner._clock = lambda: now[0]
    fits: list[float] = []
    original = learner.refit

    def counted(engine_id: str):  # type: ignore[no-untyped-def]
        fits.append(now[0])
        return original(engine_id)

    learner.refit = counted  # type: ignore[method-assign]
    for i in range(64 * 6):  # the ring fills, then 64 new samples keep falling due
        now[0] = i * 0.01
        learner._keep("e", [DecodeSample(1000 + i, 1 + i % 8, 0.011 + 1e-4 * (1 + i % 8))], "used")
    after_full = [t for t in fits if t >= 0.64]
    assert len(after_full) == 1  # 3.2 s of samples after the ring filled: one re-fit, not four


def test_a_pd_decode_whose_kv_arrived_joins_as_a_decode_not_a_prefill() -> None:
    """On a decode engine a request's first token comes after its KV moved from a prefill engine:
    that step decoded it (one more sequence of its context), it prefilled nothing."""
    fleet, learner, clock = setup()
    send(fleet, clock, "a", 50)
    step(fleet, clock, 0.02, ["a"])
    remote = RunningEntry(400, 100, 0.1, 0.0, remote_kv=True)
    fleet.reserve("e", "kv", remote)
    remote.dispatched_at = clock.now
    step(fleet, clock, 0.012, ["a"])  # its KV is still moving: a's step stays a clean decode
    step(fleet, clock, 0.013, ["a", "kv"])  # the KV arrived: both decode
    step(fleet, clock, 0.013, ["a", "kv"])
    step(fleet, clock, 0.013, ["kv", "a"])  # (closes the one before)
    prefill, decode = pending(learner)
    assert [s.input_lengths for s in prefill] == [(50,)]  # a's own prefill only
    assert [s.batch_size for s in decode] == [1, 2, 2]


def test_an_engine_sending_several_tokens_an_event_is_learned_once_its_streams_report_usage() -> None:
    """The relay counts events, the engine tokens: with three tokens an event (speculative
    decoding, vLLM --stream-interval) every interval was refuted as "tokens unseen" and the
    engine was never learned. Finished streams' usage tells how many tokens an event carries."""
    fleet, learner, clock = setup()
    record = fleet.records["e"]
    steps = generated = 0

    def stream(rid: str) -> None:
        nonlocal steps, generated
        send(fleet, clock, rid, 64)
        for _ in range(20):
            step(fleet, clock, 0.01, [rid])
            steps, generated = steps + 1, generated + 3
        record.note_tokens_per_event(60, 20)  # its usage, as the relay reads it at [DONE]
        fleet.release("e", rid)
        fleet.record_state("e", timing(steps, generated), clock.now)

    fleet.record_state("e", timing(0, 0), clock.now)
    for i in range(12):
        stream(f"r{i}")
    assert record.tokens_per_event == pytest.approx(3.0, rel=0.1)
    assert learner.sample_counts("e")[1] > 0  # intervals kept once the ratio is known

    # the check still refutes what the gateway did not see: another client's tokens on top
    kept = learner.sample_counts("e")
    send(fleet, clock, "x", 64)
    for _ in range(20):
        step(fleet, clock, 0.01, ["x"])
        steps, generated = steps + 1, generated + 3 + 2
    fleet.record_state("e", timing(steps, generated), clock.now)
    assert learner.sample_counts("e") == kept


def test_a_stream_with_usage_teaches_its_engine_the_tokens_per_event() -> None:
    fleet, _, _ = setup()
    record = fleet.records["e"]
    record.note_tokens_per_event(40, 41)  # a chat stream: a role event, then one token an event
    assert record.tokens_per_event == 1.0
    record.note_tokens_per_event(10**18, 1)  # a broken usage is bounded
    assert 1.0 < record.tokens_per_event <= 16.0


@pytest.mark.parametrize("render", ["at-send", "mid-way", "at-arrival"])
def test_a_slow_scrape_does_not_refute_what_the_engine_did_while_it_was_in_flight(render: str) -> None:
    """The engine counts as of when it renders /metrics, the gateway as of when the answer
    arrives: a scrape in flight for 0.05-0.5 s (a busy vLLM takes seconds) differed by more than
    the two steps allowed, and most intervals were refuted: no learning under load. The steps
    seen while a scrape was in flight are counted as unsure."""
    import random

    fleet, learner, clock = setup()
    rng = random.Random(0)
    done: list[tuple[float, int]] = []  # (time, steps) after each engine step

    def counted_at(t: float) -> EngineState:
        steps = max((n for at, n in done if at <= t), default=0)
        return timing(steps, steps * 4)

    fleet.record_state("e", counted_at(0.0), clock.now, clock.now)
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        send(fleet, clock, rid, 64).max_tokens = 10**6
    scrape: tuple[float, float, float] | None = None  # sent, rendered, answered
    next_scrape = clock.now + 1.0
    while clock.now < 160.0:
        step(fleet, clock, 0.02, rids)
        done.append((clock.now, len(done) + 1))
        if scrape is not None and clock.now >= scrape[2]:
            fleet.record_state("e", counted_at(scrape[1]), clock.now, scrape[0])
            scrape = None
        if scrape is None and clock.now >= next_scrape:
            lag = rng.uniform(0.05, 0.5)
            share = {"at-send": 0.0, "mid-way": rng.random(), "at-arrival": 1.0}[render]
            scrape = (clock.now, clock.now + share * lag, clock.now + lag)
            next_scrape += 1.0
    kept = learner._rings["e"].total_decode  # (the ring itself holds the latest 512)
    assert kept >= 50 * DECODE_PER_INTERVAL, kept  # nearly all of the ~159 intervals kept


def test_a_scrape_that_lands_in_the_middle_of_a_step_breaks_nothing() -> None:
    """A scrape emptied the interval's bursts while one was still open: the step's next token
    raised IndexError in the relay (the client's stream was cut with no error event)."""
    fleet, learner, clock = setup()
    fleet.record_state("e", timing(0, 0), clock.now, clock.now)
    send(fleet, clock, "a", 64)
    send(fleet, clock, "b", 64)
    clock.now += 0.01
    token(fleet, "a")
    fleet.record_state("e", timing(1, 1), clock.now, clock.now)  # between a's and b's token
    clock.now += 0.0002
    token(fleet, "b")  # same step: it raised here
    for _ in range(5):
        step(fleet, clock, 0.01, ["a", "b"])
    fleet.record_state("e", timing(6, 12), clock.now, clock.now)
    assert learner._steps["e"].bursts  # (the open burst is kept over the scrape)


def test_a_prompt_counts_from_when_it_reached_the_engine_on_the_clock_its_tokens_come_back_by() -> None:
    """Tokens come back 20 ms after the engine made them: an idle engine's prefill began when
    the prompt reached it, which on that clock is its send plus the path's delay each way (the
    least of the health checks' round trips). Counted from the send, a 50 ms prefill read 70 ms."""
    fleet, learner, clock = setup()
    for round_trip in (0.02, 2.0, -1.0, 0.03):  # (the least; a check held up; no measure)
        fleet.record_round_trip("e", round_trip)
    fleet.record_state("e", EngineState(), clock.now, clock.now - 0.5)  # (a scrape's own: not the path)
    assert learner._steps["e"].path_s == pytest.approx(0.02)
    send(fleet, clock, "a", 400)
    step(fleet, clock, 0.07, ["a"])  # the first token, seen 50 ms of prefill + 20 ms after the send
    step(fleet, clock, 0.012, ["a"])  # the next step closes the first
    prefill, _ = pending(learner)
    assert [s.seconds for s in prefill] == [pytest.approx(0.05)]


def test_a_path_delay_is_never_taken_past_its_bound_and_follows_the_latest_checks() -> None:
    """Every round trip slow: what is taken for the path stays within MAX_PATH_DELAY_S, so a
    prefill is never read shorter by more than that; once the checks come back fast again, so
    does the path (the least of the latest)."""
    from gateway.dispatch.latency_learner import MAX_PATH_DELAY_S

    fleet, learner, clock = setup()
    for _ in range(3):
        fleet.record_round_trip("e", 1.5)
    fleet.record_state("e", EngineState(), clock.now)
    assert learner._steps["e"].path_s == MAX_PATH_DELAY_S
    fleet.record_round_trip("e", 0.0005)
    fleet.record_state("e", EngineState(), clock.now)
    assert learner._steps["e"].path_s == pytest.approx(0.0005)


def _stage(fleet: Fleet, clock: Clock, rid: str, prompt: int) -> RunningEntry:
    """A P/D prefill stage sent to ``e`` (its alone mark as the flows set it)."""
    from gateway.fleet.registry import alone_since

    entry = send(fleet, clock, rid, prompt)
    entry.alone_since = alone_since(fleet.records["e"])
    return entry


def _answer(
    fleet: Fleet, learner: LatencyLearner, clock: Clock, rid: str, seconds: float, timed: bool = True
) -> None:
    clock.now += seconds
    record = fleet.records["e"]
    fleet.mark_prefilled("e", rid)
    learner.prefill_answered(record, record.running[rid], timed)
    fleet.release("e", rid)


def test_a_prefill_stage_alone_is_a_sample_and_every_stage_is_counted() -> None:
    """P/D prefill stages are not streamed: their steps and tokens were unseen by the interval's
    check (three in an interval refuted every sample in it), and none was ever a sample."""
    fleet, learner, clock = setup()
    steps = learner._steps["e"]
    _stage(fleet, clock, "a", 1000)
    _answer(fleet, learner, clock, "a", 0.13)
    assert pending(learner)[0] == [PrefillSample((1000,), pytest.approx(0.13))]  # type: ignore[list-item]
    assert (steps.seen_steps, steps.seen_tokens, steps.unsure_steps) == (1, 1, 0)
    # two at once: neither is timed, each counted (its step may be the other's too)
    _stage(fleet, clock, "b", 500)
    _stage(fleet, clock, "c", 500)
    _answer(fleet, learner, clock, "b", 0.1)
    _answer(fleet, learner, clock, "c", 0.01)
    assert len(pending(learner)[0]) == 1
    assert (steps.seen_steps, steps.seen_tokens, steps.unsure_steps) == (1, 3, 2)
    # a bootstrap prefill (answered once its KV moved) is counted, not timed
    _stage(fleet, clock, "d", 500)
    _answer(fleet, learner, clock, "d", 0.5, timed=False)
    assert len(pending(learner)[0]) == 1 and steps.unsure_steps == 3


def test_a_chunked_prefill_stage_counts_its_steps_and_is_no_sample() -> None:
    """A prompt past the engine's chunk runs in several steps: one seen where the engine ran four
    refuted the interval, and a prompt of two chunks was timed as one step's."""
    config = EngineConfig(url="http://127.0.0.1:9", kind="sim", model="m", name="e")  # type: ignore[arg-type]
    fleet = fleet_of([config], 3.0)
    learner = LatencyLearner({"e": PRIOR}, {"e": 2048})
    clock = Clock()
    learner.attach(fleet, clock, GAP)
    _stage(fleet, clock, "a", 8000)
    _answer(fleet, learner, clock, "a", 0.9)
    steps = learner._steps["e"]
    assert steps.seen_steps == 4 and not pending(learner)[0]
    _stage(fleet, clock, "b", 2000)
    _answer(fleet, learner, clock, "b", 0.2)
    assert steps.seen_steps == 5 and len(pending(learner)[0]) == 1
