"""What the collocated flow sends upstream: the client's bytes with members spliced in, never two
copies of one key, and a re-serialised body only when a field must go."""

from __future__ import annotations

import json
from typing import Any, cast

import aiohttp
import pytest

from gateway.api.request_parse import parse_request
from gateway.engines import adapter_for
from gateway.fleet.registry import EngineRecord
from gateway.serving.call import Call
from gateway.serving.collocated import CollocatedFlow
from gateway.settings import EngineConfig
from policies.slo import SloSource, SloTarget

TARGET = SloTarget(ttft_s=1.0, tpot_s=0.1, slo_class="c", source=SloSource.TASK)


async def _noop(_: object) -> None:
    return None


def record(kind: str, priority_scheduling: bool) -> EngineRecord:
    config = EngineConfig.model_validate(
        {"url": "http://127.0.0.1:9", "kind": kind, "model": "m", "priority_scheduling": priority_scheduling}
    )
    return EngineRecord(adapter_for(config, cast(aiohttp.ClientSession, None), 1.0))


def flow() -> CollocatedFlow:
    made = CollocatedFlow.__new__(CollocatedFlow)
    made.shared_offset = lambda: 0.0  # (deadlines on the call's own clock: 10 s + 1 s)
    return made


def call(raw: bytes) -> Call:
    return Call(parse_request("chat", raw, 16), "sg-1", "c", 10.0, _noop, TARGET, None, (), {})


def keys(body: bytes) -> list[str]:
    pairs: list[tuple[str, Any]] = json.loads(body, object_pairs_hook=lambda p: p)
    return [k for k, _ in pairs]


@pytest.mark.parametrize("spaces", [b"", b"  \n "])
def test_stream_usage_is_spliced_into_the_clients_bytes(spaces: bytes) -> None:
    raw = spaces + b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"x":1.50}'
    sent = flow().body_for(call(raw), record("openai", False))
    assert sent.endswith(b'"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"x":1.50}')
    assert json.loads(sent)["stream_options"] == {"include_usage": True}
    assert sorted(keys(sent)) == ["messages", "model", "stream", "stream_options", "x"]


def test_priority_is_spliced_once_and_a_clients_own_is_replaced() -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    sent = flow().body_for(call(raw), record("vllm", True))
    assert json.loads(sent)["priority"] == 11_000 and keys(sent).count("priority") == 1
    own = b'{"model":"m","priority":-5,"messages":[{"role":"user","content":"hi"}]}'
    sent = flow().body_for(call(own), record("vllm", True))
    assert keys(sent).count("priority") == 1 and json.loads(sent)["priority"] == 11_000


def test_a_field_removed_for_one_engine_stays_removed_for_the_next() -> None:
    """The client's priority is dropped for an engine that rejects it; a retry on an engine that
    takes one must not find the client's value again in the raw bytes."""
    c = call(b'{"model":"m","priority":-5,"messages":[{"role":"user","content":"hi"}],"stream":true}')
    f = flow()
    first = f.body_for(c, record("openai", False))
    assert "priority" not in json.loads(first)
    second = f.body_for(c, record("vllm", True))
    assert keys(second).count("priority") == 1 and json.loads(second)["priority"] == 11_000
    assert keys(second).count("stream_options") == 1


def test_what_one_engine_is_sent_does_not_reach_the_next() -> None:
    """The client's own stream_options made the body re-serialised for a vLLM engine: what was
    added for it went into the client's body itself and stayed there for a retry on an engine of
    another kind (its priority was taken out again, a migration's return_token_ids was not)."""
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{}}'
    c = call(raw)
    f = flow()
    first = json.loads(f.body_for(c, record("vllm", True)))
    assert first["priority"] == 11_000 and first["stream_options"] == {"include_usage": True}
    second = json.loads(f.body_for(c, record("sglang", False)))
    assert "priority" not in second
    assert second["stream_options"] == {"include_usage": True}
    assert c.request.body == json.loads(raw)  # the client's body as it came


def test_an_untouched_body_is_sent_as_is() -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}], "stream": false}'
    c = call(raw)
    assert flow().body_for(c, record("openai", False)) is c.request.raw


def test_a_body_re_serialised_for_one_field_keeps_the_spliced_other() -> None:
    """The client's stream_options must be merged (re-serialised), and the engine's priority must
    still go with it (found by the fuzz test: the priority was lost)."""
    raw = b'{"model":"m","messages":[{"role":"user","content":""}],"stream":true,"stream_options":{"include_usage":false}}'
    sent = json.loads(flow().body_for(call(raw), record("vllm", True)))
    assert sent["priority"] == 11_000 and sent["stream_options"] == {"include_usage": True}


def test_a_late_request_ranks_behind_every_on_time_one_on_a_deadline_scheduling_engine() -> None:
    """HyperFlexis serves requests whose TTFT is already lost after the on-time ones (its late
    lane); the engine's queue must agree, or a past deadline would put them first there. vLLM
    runs the lowest priority first, SGLang (by default) the highest."""
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    for kind, sign in (("vllm", 1), ("sglang", -1)):
        engine = record(kind, True)
        on_time = json.loads(flow().body_for(call(raw), engine))["priority"]
        late = json.loads(flow().body_for(call(raw), engine, late=True))["priority"]
        assert on_time == sign * 11_000
        # later than any on-time deadline within days of it (engines run the lower first)
        assert sign * late > sign * on_time + 86_400_000
    huge = record("vllm", True).adapter.deadline_priority(1e300, late=True)
    assert huge == (1 << 53) - 1  # still an integer every JSON parser reads exactly


def test_every_replica_sends_one_engine_priorities_on_the_same_time_base(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each replica counted its deadlines from its own start: one started an hour later sent
    numbers an hour smaller, and a shared engine ran its lax requests before an older replica's
    urgent ones. Deadlines now count from one instant of the wall clock, read per request."""
    import types

    import gateway.serving.collocated as collocated
    from gateway.engines.base import PRIORITY_EPOCH_S

    wall = PRIORITY_EPOCH_S + 86_400.0  # (a day into the epoch)
    engine = record("vllm", True)

    def sent(booted_s_ago: float, ttft_s: float) -> int:
        """The priority a replica on a machine booted that long ago sends for a request arriving
        now with that TTFT target (the monotonic clock counts from boot)."""
        monotonic = booted_s_ago
        clock = types.SimpleNamespace(time=lambda: wall, monotonic=lambda: monotonic)
        monkeypatch.setattr(collocated, "time", clock)
        replica = CollocatedFlow.__new__(CollocatedFlow)
        replica.shared_offset = collocated._shared_offset
        target = SloTarget(ttft_s=ttft_s, tpot_s=0.1, slo_class="c", source=SloSource.TASK)
        c = Call(
            parse_request("chat", b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', 16),
            "sg-1",
            "c",
            monotonic,
            _noop,
            target,
            None,
            (),
            {},
        )
        return int(json.loads(replica.body_for(c, engine))["priority"])

    urgent_on_old, lax_on_new = sent(3_600.0, 0.7), sent(5.0, 20.0)
    assert urgent_on_old < lax_on_new  # (vLLM runs the lower first)
    assert sent(3_600.0, 0.7) == sent(5.0, 0.7) == round((86_400.0 + 0.7) * 1000)
