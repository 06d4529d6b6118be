"""HyperFlexis with the prefix index's matches (``prefix_preference``): literal queues and workers."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest

from policies.hyperflexis import Held, HyperFlexisParams, RunningRequest, dispatch
from policies.queue_order import OrderContext
from tests.policies.test_hyperflexis import DECODE, PREFILL, req, worker

ON = HyperFlexisParams(prefix_preference=True, budget_ttft_share=1.0)


def lookup(table: Mapping[str, Mapping[str, float]], shared: Mapping[str, Mapping[str, float]] | None = None):  # type: ignore[no-untyped-def]
    """A prefix lookup over literal fractions; what is cached is shared too unless ``shared`` says."""
    calls: list[str] = []

    def held(rid: str) -> Held | None:
        calls.append(rid)
        cached = table.get(rid)
        if cached is None:
            return None
        return Held(cached, cached if shared is None else shared.get(rid, {}))

    held.calls = calls  # type: ignore[attr-defined]
    return held


def placed(decision) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {a.request_id: a.engine_id for a in decision.assignments}


def test_request_goes_to_the_worker_holding_its_prefix_though_another_looks_first() -> None:
    # w0 is the earlier worker (it looks first); w1 holds 900 of a's 1,000 prompt tokens
    queue = [req("a", prompt=1000), req("b", prompt=100)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0)]
    held = lookup({"a": {"w1": 0.9}})
    assert placed(dispatch(queue, workers, 0.0, ON, cached=held)) == {"a": "w1", "b": "w0"}
    # the same call without the lookup, or with the preference off: queue order, first worker
    assert placed(dispatch(queue, workers, 0.0, ON)) == {"a": "w0", "b": "w0"}
    off = HyperFlexisParams(budget_ttft_share=1.0)
    assert placed(dispatch(queue, workers, 0.0, off, cached=held)) == {"a": "w0", "b": "w0"}


def test_small_difference_is_not_worth_leaving_for() -> None:
    queue = [req("a", prompt=1000)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0)]
    # w1 holds 5 % more than w0: below the 10 % margin
    held = lookup({"a": {"w0": 0.5, "w1": 0.55}})
    assert placed(dispatch(queue, workers, 0.0, ON, cached=held)) == {"a": "w0"}
    # at a 2 % margin it is worth it
    assert placed(
        dispatch(
            queue, workers, 0.0, HyperFlexisParams(prefix_preference=True, prefix_margin=0.02), cached=held
        )
    ) == {"a": "w1"}


def test_only_workers_still_to_look_in_this_turn_are_waited_for() -> None:
    # w1 is not mature: w0 must not leave the request to it (it might wait a whole turn)
    queue = [req("a", prompt=1000)]
    workers = [worker("w0", maturity=0.0), worker("w1", maturity=0.5)]
    held = lookup({"a": {"w1": 1.0}})
    assert placed(dispatch(queue, workers, 0.0, ON, cached=held)) == {"a": "w0"}


def test_request_the_better_worker_turns_down_goes_back_to_the_first() -> None:
    # w1 holds the prompt but has no KV room for its output: w0 looks again after w1 and takes it
    queue = [req("a", prompt=1000, out=100)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0, kv=50)]
    held = lookup({"a": {"w1": 1.0}})
    decision = dispatch(queue, workers, 0.0, ON, cached=held)
    assert placed(decision) == {"a": "w0"}
    assert decision.maturity["w0"] > 0.0  # a hold for the prefill it took, not a park
    assert math.isinf(decision.wake_at)


def test_second_look_that_takes_nothing_keeps_the_first_looks_hold() -> None:
    # w0 takes b on its first look and leaves a to w1, which takes it: w0's second look finds
    # nothing and its maturity stays the hold for b
    queue = [req("a", prompt=1000), req("b", prompt=200)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0)]
    held = lookup({"a": {"w1": 1.0}})
    decision = dispatch(queue, workers, 0.0, ON, cached=held)
    assert placed(decision) == {"a": "w1", "b": "w0"}
    alone = dispatch([req("b", prompt=200)], [worker("w0", maturity=-1.0)], 0.0, ON)
    assert decision.maturity["w0"] == pytest.approx(alone.maturity["w0"])


def test_cached_tokens_are_not_predicted_as_prefill() -> None:
    # the budget over a 0.1 s TTFT at 0.05 s TPOT is 800 tokens (see test_token_budget_limits_the_batch):
    # two 500-token prompts fit one turn only when 400 of each are cached on the worker
    queue = [req("a", prompt=500, ttft=0.1, tpot=0.05), req("b", prompt=500, ttft=0.1, tpot=0.05)]
    workers = [worker("w")]
    assert placed(dispatch(queue, workers, 0.0, ON)) == {"a": "w"}
    held = lookup({"a": {"w": 0.8}, "b": {"w": 0.8}})
    decision = dispatch(queue, workers, 0.0, ON, cached=held)
    assert placed(decision) == {"a": "w", "b": "w"}
    # the hold amortises 200 prefill tokens, not 1,000
    e_p = PREFILL[0] + PREFILL[1] * 200
    assert decision.prefill_s["w"] == pytest.approx(e_p)


def test_idle_backfill_leaves_a_late_head_to_the_worker_holding_it() -> None:
    # a is late everywhere (arrived 10 s ago with a 1 s TTFT): the idle w0 would backfill it,
    # but w1, still to look, holds it all
    queue = [req("a", prompt=1000, arrival=-10.0)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0)]
    held = lookup({"a": {"w1": 1.0}})
    assert placed(dispatch(queue, workers, 0.0, ON, cached=held)) == {"a": "w1"}
    assert placed(dispatch(queue, workers, 0.0, ON)) == {"a": "w0"}


def test_busy_better_worker_does_not_starve_the_request() -> None:
    # w1 holds the prompt but is loaded enough that a's chance there is below theta: a goes to w0
    # in the same call (no request is left waiting for an event because of the preference)
    busy = tuple(
        RunningRequest(prompt_tokens=2000, generated=0, tpot_slo=0.1, prefilled=False) for _ in range(4)
    )
    queue = [req("a", prompt=1000, ttft=0.5)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0, running=busy)]
    held = lookup({"a": {"w1": 1.0}})
    decision = dispatch(queue, workers, 0.0, ON, cached=held)
    assert placed(decision) == {"a": "w0"}


def test_prefix_margin_is_checked() -> None:
    with pytest.raises(ValueError, match="prefix_margin"):
        HyperFlexisParams(prefix_margin=1.5)
    with pytest.raises(ValueError, match="prefix_max_ratio"):
        HyperFlexisParams(prefix_max_ratio=0.5)


del DECODE  # (imported for symmetry with the module it extends)


def test_a_cached_prefix_needs_no_new_kv() -> None:
    # 1,000 prompt + 100 output tokens; 300 KV tokens free: only the holder of 900 fits it
    queue = [req("a", prompt=1000, out=100)]
    held = lookup({"a": {"w": 0.9}})
    assert placed(dispatch(queue, [worker("w", kv=300, running=BUSY)], 0.0, ON)) == {}
    assert placed(dispatch(queue, [worker("w", kv=300, running=BUSY)], 0.0, ON, cached=held)) == {"a": "w"}
    # cached but used by no running request: free memory the engine reuses, so KV to find all the same
    idle_cache = lookup({"a": {"w": 0.9}}, shared={"a": {}})
    assert placed(dispatch(queue, [worker("w", kv=300, running=BUSY)], 0.0, ON, cached=idle_cache)) == {}


BUSY = (RunningRequest(prompt_tokens=100, generated=10, tpot_slo=0.1, prefilled=True),)


def test_a_request_waits_for_a_holder_maturing_within_its_wait() -> None:
    # w1 holds the prompt and matures at 0.1; a arrived at 0 with a 1 s TTFT: it may wait for w1
    # until 0.2 (prefix_max_wait 0.2 of its TTFT), and w0, which leaves it, looks again then
    queue = [req("a", prompt=1000, ttft=1.0)]
    held = lookup({"a": {"w1": 1.0}})
    decision = dispatch(queue, [worker("w0")], 0.0, ON, cached=held, soon={"w1": (0.1, 0)})
    assert placed(decision) == {}
    assert decision.maturity["w0"] == pytest.approx(0.2)
    # a holder maturing after the wait would end is not waited for
    assert placed(dispatch(queue, [worker("w0")], 0.0, ON, cached=held, soon={"w1": (0.3, 0)})) == {"a": "w0"}
    # nor once the wait has run out (w0 looking again at 0.2)
    assert placed(
        dispatch(queue, [worker("w0", maturity=0.2)], 0.2, ON, cached=held, soon={"w1": (0.21, 0)})
    ) == {"a": "w0"}
    # nor with prefix_max_wait 0
    no_wait = HyperFlexisParams(prefix_preference=True, prefix_max_wait=0.0)
    assert placed(dispatch(queue, [worker("w0")], 0.0, no_wait, cached=held, soon={"w1": (0.1, 0)})) == {
        "a": "w0"
    }


def test_a_holder_over_the_imbalance_bound_is_not_preferred() -> None:
    # w1 holds the prompt but runs 3 requests more than the idle w0 (spread 2, ratio 1.5): w0 takes it
    three = BUSY * 3
    queue = [req("a", prompt=1000)]
    held = lookup({"a": {"w1": 1.0}})
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0, running=three)]
    assert placed(dispatch(queue, workers, 0.0, ON, cached=held)) == {"a": "w0"}
    # two more than w0: within the bound, left to w1
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0, running=BUSY * 2)]
    assert placed(dispatch(queue, workers, 0.0, ON, cached=held)) == {"a": "w1"}
    # the same bound for a holder maturing soon: its running count comes with its maturity
    assert placed(dispatch(queue, [worker("w0")], 0.0, ON, cached=held, soon={"w1": (0.1, 3)})) == {"a": "w0"}
    assert placed(dispatch(queue, [worker("w0")], 0.0, ON, cached=held, soon={"w1": (0.1, 2)})) == {}


def test_a_second_look_starts_from_what_the_first_took() -> None:
    # w0 (1,500 KV free) takes q0-q3 (4 x 250) and leaves a (1,100 of KV) to w1, which has no room
    # for it; looking again, w0 must not take a on top of the 1,000 it already committed
    queue = [req("a", prompt=1000, out=100)] + [req(f"q{i}", prompt=200, out=50) for i in range(4)]
    workers = [worker("w0", maturity=-1.0, kv=1500), worker("w1", maturity=0.0, kv=50)]
    held = lookup({"a": {"w1": 1.0}})
    decision = dispatch(queue, workers, 0.0, ON, cached=held)
    on_w0 = [a.request_id for a in decision.assignments if a.engine_id == "w0"]
    kv = {"a": 1100}
    assert sum(kv.get(r, 250) for r in on_w0) <= 1500
    assert "a" not in on_w0


def test_a_second_look_spends_only_the_budget_left() -> None:
    # eq.(5) allows 800 prompt tokens a turn (0.1 s TTFT, 0.05 s TPOT): w0 takes b (500) and leaves
    # a to w1, which cannot take it (no KV); a (500) would break the budget on w0's second look
    # (their own TTFT, 0.2 s, leaves a room on w0 after b; the budget is the fleet's tightest, 0.1 s)
    queue = [req("a", prompt=500, ttft=0.2, tpot=0.05), req("b", prompt=500, ttft=0.2, tpot=0.05)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0, kv=10)]
    held = lookup({"a": {"w1": 1.0}})
    decision = dispatch(queue, workers, 0.0, ON, tightest_ttft_s=0.1, cached=held)
    assert placed(decision) == {"b": "w0"}
    assert decision.prefill_s["w0"] == pytest.approx(PREFILL[0] + PREFILL[1] * 500)


def test_a_worker_that_left_its_only_request_stays_mature_not_full() -> None:
    # an idle w0 leaves a to w1, which takes it: w0 is not "full" (it would sleep until its own
    # next event, idle) and keeps its maturity, so the next arrival finds it at once
    queue = [req("a", prompt=1000)]
    workers = [worker("w0", maturity=-1.0), worker("w1", maturity=0.0)]
    decision = dispatch(queue, workers, 0.0, ON, cached=lookup({"a": {"w1": 1.0}}))
    assert placed(decision) == {"a": "w1"}
    assert "w0" not in decision.full
    assert decision.maturity.get("w0", -1.0) <= 0.0


def test_an_idle_worker_leaving_a_late_head_looks_again() -> None:
    # a is late everywhere and asks for more KV than the busy holder w1 has: only idle backfill
    # can place it. w0 leaves it to w1 first; w1 does not take it; w0's second look does.
    busy = (RunningRequest(prompt_tokens=100, generated=10, tpot_slo=0.1, prefilled=True),)
    queue = [req("a", prompt=1000, arrival=-10.0, out=100_000)]
    workers = [worker("w0", maturity=-1.0, kv=50_000), worker("w1", maturity=0.0, running=busy, kv=50_000)]
    held = lookup({"a": {"w1": 1.0}})
    # the late lane (the gateway's queue order at theta >= 0.5) ends the main scan at a, before
    # any prefix lookup: only the idle backfill sees it
    lane = OrderContext(prefill_tokens_per_s=1.0 / PREFILL[1], decode_step_s=0.01, prefill_base_s=PREFILL[0])
    decision = dispatch(queue, workers, 0.0, ON, late_last=lane, cached=held, queue_min_need=101_000)
    assert placed(decision) == {"a": "w0"}


def test_a_hold_shorter_than_the_recheck_is_refused() -> None:
    # (with max_hold_s 0 a worker's hold ended at once and a look that took nothing spun forever)
    with pytest.raises(ValueError, match="max_hold_s"):
        HyperFlexisParams(max_hold_s=0.0)
