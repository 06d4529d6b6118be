"""gateway/sim/engine.py + output.py in virtual time: batching, scheduling, preemption, roles,
deterministic output and continuation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sim.engine import EngineModel, Phase
from gateway.sim.output import TokenStream
from gateway.sim.responses import OutputState, batch_deltas
from gateway.tokenizer import EOS_ID, decode
from tests.sim.helpers import profile, request, run_virtual

ZERO_LAT = {k: 0.0 for k in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c")}
UNIT = {**ZERO_LAT, "prefill_a": 1.0, "decode_a": 1.0}  # every step takes 1 simulated second


def test_single_request_timing_follows_eq1_and_eq2() -> None:
    prof = profile(
        latency={
            "prefill_a": 0.02,
            "prefill_b": 1e-4,
            "prefill_c": 0.0,
            "decode_a": 0.01,
            "decode_b": 0.0,
            "decode_c": 0.001,
        }
    )
    model = EngineModel(prof)
    r = request("r", list(range(300, 1300)), 5, ignore_eos=True)
    model.add(r)
    end = run_virtual(model)
    assert r.first_token_at == pytest.approx(0.02 + 1e-4 * 1000)
    assert end == pytest.approx(0.12 + 4 * 0.011)
    assert r.finish_reason == "length" and len(r.output) == 5


def test_batch_limit_max_num_seqs() -> None:
    model = EngineModel(profile(max_num_seqs=2, latency=UNIT))
    for i in range(3):
        model.add(request(f"r{i}", [300 + i] * 20, 3, ignore_eos=True))
    batch = model.plan(0.0)
    assert batch is not None and len(batch.prefills) == 2
    assert len(model.running) == 2 and len(model.waiting) == 1


def test_token_budget_chunks_prefill() -> None:
    model = EngineModel(profile(max_num_batched_tokens=64, latency=UNIT))
    model.add(request("long", list(range(300, 500)), 2, ignore_eos=True))
    chunks = []
    now = 0.0
    while model.has_work:
        batch = model.plan(now)
        assert batch is not None
        chunks.append([n for _, n in batch.prefills])
        now += batch.duration
        model.finish(batch, now)
    assert chunks[:4] == [[64], [64], [64], [8]]


def test_fcfs_versus_priority_order() -> None:
    for policy, expected in (("fcfs", ["a", "b", "c"]), ("priority", ["c", "b", "a"])):
        model = EngineModel(profile(max_num_seqs=1, latency=UNIT), priority_scheduling=policy == "priority")
        for rid, prio, at in (("a", 5, 0.0), ("b", 1, 0.1), ("c", -3, 0.2)):
            model.add(request(rid, [300] * 8, 1, arrival=at, priority=prio, ignore_eos=True))
        order = []
        now = 0.0
        while model.has_work:
            batch = model.plan(now)
            assert batch is not None
            order += [r.request_id for r, _ in batch.prefills]
            now += batch.duration
            model.finish(batch, now)
        assert order == expected, policy


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 16 tokens; two requests of 40-token prompts each grow until they do not fit
    model = EngineModel(profile(num_gpu_blocks=6, latency=UNIT))
    a = request("a", [301] * 40, 40, ignore_eos=True)
    b = request("b", [302] * 40, 40, arrival=0.1, ignore_eos=True)
    model.add(a)
    model.add(b)
    run_virtual(model)
    assert model.counters.preemptions >= 1
    assert len(a.output) == 40 and len(b.output) == 40
    # recompute must not change what is generated
    assert a.output == _alone([301] * 40, 40) and b.output == _alone([302] * 40, 40)
    assert model.cache.usage == 0.0


def test_a_request_ended_by_its_client_while_preempted_never_runs_again() -> None:
    """A stop string is matched by the server after the engine's step, when the next step may
    already have preempted the request: ended then, it stayed in the waiting queue and was
    recomputed and run to its limit, holding KV for no one and counted as finished twice."""
    model = EngineModel(profile(num_gpu_blocks=6, latency=UNIT))
    requests = [
        request(name, [300 + i] * 40, 40, arrival=0.1 * i, ignore_eos=True) for i, name in enumerate("abc")
    ]
    for r in requests:
        model.add(r)
    now = 0.0
    while True:  # until a step leaves a preempted request waiting
        batch = model.plan(now)
        assert batch is not None
        preempted = next((r for r in model.waiting if r.output), None)
        if preempted is not None:
            break
        now += batch.duration
        model.finish(batch, now)
    # the server reads the victim's last token only now, and it completes a stop string
    model.complete(preempted, "stop")
    assert preempted not in model.waiting and preempted.phase is Phase.FINISHED
    produced = len(preempted.output)
    now += batch.duration
    model.finish(batch, now)
    run_virtual(model, start=now)
    assert len(preempted.output) == produced  # never scheduled again
    assert all(len(r.output) == 40 for r in requests if r is not preempted)
    assert model.counters.finished == {"stop": 1, "length": 2}
    assert model.cache.usage == 0.0 and not model.has_work


def _alone(prompt: list[int], n: int) -> list[int]:
    model = EngineModel(profile(latency=UNIT))
    r = request("x", prompt, n, ignore_eos=True)
    model.add(r)
    run_virtual(model)
    return r.output


def test_prefix_cache_hits_are_counted() -> None:
    model = EngineModel(profile(latency=UNIT))
    prefix = list(range(300, 1300))
    first = request("a", [*prefix, 5], 1)
    model.add(first)
    run_virtual(model)
    second = request("b", [*prefix, 6, 7], 1)
    model.add(second)
    run_virtual(model)
    assert second.cached_tokens == 992  # 62 full blocks of 16
    assert model.counters.prefix_hits == 992
    assert model.counters.prefix_queries == 1001 + 1002


def test_abort_frees_blocks() -> None:
    model = EngineModel(profile(latency=UNIT))
    r = request("r", list(range(300, 400)), 100, ignore_eos=True)
    model.add(r)
    batch = model.plan(0.0)
    assert batch is not None
    model.finish(batch, 1.0)
    assert model.cache.usage > 0
    model.abort("r")
    assert model.cache.usage == 0.0 and not model.running and not model.has_work


def test_prefill_role_holds_blocks_until_read_or_lease() -> None:
    model = EngineModel(profile(latency=UNIT))
    r = request("p", list(range(300, 400)), 1, prefill_only=True)
    model.add(r)
    run_virtual(model)
    assert r.phase is Phase.HELD and len(r.output) == 1 and model.cache.usage > 0
    assert model.expire_held(10.0, lease_s=30.0) == []
    assert model.expire_held(40.0, lease_s=30.0) == ["p"]
    assert model.cache.usage == 0.0


def test_decode_role_waits_for_transfer_then_skips_prefill() -> None:
    model = EngineModel(profile(latency={**ZERO_LAT, "prefill_a": 0.5, "prefill_b": 0.01, "decode_a": 0.01}))
    r = request("d", list(range(300, 400)), 3, remote_kv=True, kv_ready_at=2.0, ignore_eos=True)
    model.add(r)
    end = run_virtual(model)
    assert (
        r.first_token_at is not None and 2.0 < r.first_token_at < 2.6
    )  # one-token step, not a 1.5 s prefill
    assert end == pytest.approx(r.first_token_at + 0.02)
    assert r.output == _alone(list(range(300, 400)), 3)


def test_output_len_ends_with_stop_and_ignores_eos() -> None:
    model = EngineModel(profile(latency=UNIT))
    r = request("r", [400] * 10, 500, output_len=300)
    model.add(r)
    run_virtual(model)
    assert len(r.output) == 300 and r.finish_reason == "stop" and EOS_ID not in r.output


# -- deterministic output and continuation ----------------------------------------------------

prompts = st.lists(st.integers(0, 36_000), min_size=1, max_size=200)


@settings(max_examples=60, deadline=None)
@given(prompt=prompts, n=st.integers(1, 120), k=st.integers(0, 120), seed=st.integers(0, 3))
def test_continuation_reproduces_the_rest(prompt: list[int], n: int, k: int, seed: int) -> None:
    full = _generate(prompt, n, seed)
    k = min(k, len(full))
    rest = _generate(prompt + full[:k], n - k, seed) if n - k > 0 else []
    if k < len(full):
        assert rest == full[k:]


def _generate(prompt: list[int], n: int, seed: int) -> list[int]:
    model = EngineModel(profile(latency=UNIT), seed=seed)
    r = request("r", prompt, n)
    model.add(r)
    run_virtual(model)
    return [t for t in r.output if t != EOS_ID]


def test_output_is_text_like_and_eos_comes_from_the_function() -> None:
    stream = TokenStream([1, 2, 3], ignore_eos=False)
    tokens = [stream.next_token() for _ in range(3000)]
    assert EOS_ID in tokens  # about one in 200
    text = decode([t for t in tokens[:50] if t != EOS_ID])
    assert text.count(" ") >= 30
    assert TokenStream([1, 2, 3], ignore_eos=True).next_token() == tokens[0] or tokens[0] == EOS_ID


# -- stop strings -----------------------------------------------------------------------------


def test_stop_string_cuts_text_and_streaming_never_leaks_part_of_it() -> None:
    stream = TokenStream([7, 7, 7], ignore_eos=True)
    tokens = [stream.next_token() for _ in range(40)]
    text = decode(tokens)
    stop = text[20:26]
    out = OutputState((stop,))
    sent = ""
    for token in tokens:
        done = out.add(token)
        piece = out.delta(done)
        sent += piece
        assert stop not in sent
        for cut in range(1, len(stop)):
            assert not (sent.endswith(stop[:cut]) and not done and text.find(stop) == len(sent) - cut)
        if done:
            break
    assert out.stopped and sent == text[: text.find(stop)]


def test_a_finished_batch_never_leaks_part_of_a_stop_string_its_later_tokens_complete() -> None:
    """A streaming handler behind the engine reads a whole finished batch at once: the text held
    back for stop strings went out with the batch's first token, before the later tokens could
    complete the stop string it began (the non-streamed answer, cut before it, differed)."""
    stream = TokenStream([7, 7, 7], ignore_eos=True)
    tokens = [stream.next_token() for _ in range(40)]
    text = decode(tokens)
    stop = text[20:26]
    whole = OutputState((stop,))
    for token in tokens:
        if whole.add(token):
            break
    for first in range(len(tokens)):  # the handler fell behind from this token on
        out = OutputState((stop,))
        sent = "".join(text for text, _, _ in batch_deltas(out, tokens[:first], False))
        if not out.stopped:  # (a stop ends the stream: nothing after it is read)
            sent += "".join(text for text, _, _ in batch_deltas(out, tokens[first:], True))
        sent += out.delta(True)
        assert sent == whole.text == text[: text.find(stop)], first


def test_pooling_request_prefills_and_ends_without_a_token() -> None:
    prof = profile(latency={**ZERO_LAT, "prefill_a": 0.02, "prefill_b": 1e-4})
    model = EngineModel(prof)
    r = request("e", list(range(300, 800)), 1, pooling=True)
    model.add(r)
    end = run_virtual(model)
    assert end == pytest.approx(0.02 + 1e-4 * 500)  # one prefill step, no decode step
    assert r.output == [] and r.finish_reason == "stop" and r.phase is Phase.FINISHED
    assert model.counters.prompt_tokens == 500 and model.counters.generation_tokens == 0
    assert model.cache.usage == 0.0 and not model.has_work


def test_choices_draw_from_distinct_output_functions() -> None:
    outputs = []
    for choice in range(3):
        model = EngineModel(profile(latency=UNIT))
        r = request(f"c{choice}", list(range(300, 340)), 12, ignore_eos=True, choice=choice)
        model.add(r)
        run_virtual(model)
        outputs.append(r.output)
    assert outputs[0] == _alone(list(range(300, 340)), 12)  # choice 0 is the plain n=1 output
    assert len({tuple(o) for o in outputs}) == 3
