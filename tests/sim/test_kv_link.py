"""The decode engine's ingress KV link: one serial FIFO channel shared by every transfer into it."""

from __future__ import annotations

import pytest

from gateway.sim.engine import EngineModel
from gateway.sim.profiles import Transfer
from tests.sim.helpers import profile, request, run_virtual

#: 1 ms setup + tokens x 1 MB / 1 GB/s: 1,000 tokens take 1.001 s
LINK = profile(kv_bytes_per_token=1_000_000, transfer=Transfer(link_bandwidth_gbps=1.0, link_latency_s=0.001))
FAST = {k: 0.0 for k in ("prefill_a", "prefill_b", "prefill_c", "decode_b", "decode_c")} | {"decode_a": 0.001}


def test_transfers_into_one_engine_queue_behind_each_other() -> None:
    model = EngineModel(LINK)
    ready = [model.reserve_link(1000, now=0.0) for _ in range(3)]
    assert ready == pytest.approx([1.001, 2.002, 3.003])
    # a transfer reserved after the link went idle starts at once
    assert model.reserve_link(1000, now=10.0) == pytest.approx(11.001)
    assert model.link_transfers == 4 and model.link_busy_s == pytest.approx(4.004)


def test_engines_have_their_own_links() -> None:
    a, b = EngineModel(LINK), EngineModel(LINK)
    assert a.reserve_link(1000, 0.0) == pytest.approx(b.reserve_link(1000, 0.0))


def test_first_tokens_follow_the_link_order() -> None:
    prof = LINK.model_copy(update={"latency": LINK.latency.model_copy(update=FAST)})
    model = EngineModel(prof)
    requests = []
    for i in range(3):
        r = request(f"d{i}", list(range(300, 1300)), 2, remote_kv=True, ignore_eos=True)
        r.kv_ready_at = model.reserve_link(len(r.prompt), now=0.0)
        model.add(r)
        requests.append(r)
    run_virtual(model)
    firsts = [r.first_token_at for r in requests]
    assert all(f is not None for f in firsts)
    assert firsts == pytest.approx([1.001, 2.002, 3.003])  # the last prompt token costs nothing here


def test_reset_frees_the_link() -> None:
    model = EngineModel(LINK)
    model.reserve_link(1000, 0.0)
    model.reset()
    assert model.reserve_link(1000, 0.5) == pytest.approx(1.501)
