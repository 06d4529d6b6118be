"""The state the offline simulator scrapes equals what the gateway parses from the engine's /metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.engines.vllm import parse_vllm_metrics
from gateway.sim.metrics import engine_state
from gateway.sim.server import SimConfig, SimServer
from tests.sim.helpers import MODEL, profile, request


def test_engine_state_is_what_the_vllm_adapter_reads_from_the_metrics_text() -> None:
    server = SimServer(SimConfig(profile(max_num_seqs=3, num_gpu_blocks=64), MODEL, engine_id="e0"))
    model = server.model
    for i in range(6):  # more than fit: some run, some wait, some share a cached prefix
        model.add(request(f"r{i}", [7] * 48 + [i] * (20 + 10 * i), 8, ignore_eos=True))
    now = 0.0
    for _ in range(5):
        batch = model.plan(now)
        assert batch is not None
        now += batch.duration
        model.finish(batch, now)
    state = engine_state(model)
    assert state.num_running == 3 and state.num_waiting == 3 and 0 < state.kv_usage < 1
    parsed = parse_vllm_metrics(generate_latest(server.metrics_.registry).decode())
    assert parsed == state
