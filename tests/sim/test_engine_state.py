"""The state the offline simulator scrapes equals what the gateway parses from the engine's /metrics."""

from __future__ import annotations

import pytest
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


def test_the_engines_own_timing_is_what_the_adapter_reads_and_what_the_model_did() -> None:
    """vLLM's per-step and per-finished-request statistics: iteration tokens per step that produced
    output, and queue / prefill / decode time of each finished request, in the exported text and in
    what the simulator scrapes alike (exact floats), and equal to the model's own timeline."""
    server = SimServer(SimConfig(profile(max_num_seqs=2, num_gpu_blocks=64), MODEL, engine_id="e0"))
    model = server.model
    requests = [request(f"r{i}", [i + 1] * (30 + 40 * i), 4 + i, ignore_eos=True) for i in range(4)]
    for r in requests:
        model.add(r)
    now, steps, tokens = 0.0, 0, 0
    while model.has_work:
        batch = model.plan(now)
        assert batch is not None
        now += batch.duration
        result = model.finish(batch, now)
        firsts = sum(
            len(r.prompt) for r, _ in result.tokens if r.first_token_at == now and len(r.output) == 1
        )
        steps += 1
        tokens += firsts + len(result.tokens)
        parsed = parse_vllm_metrics(generate_latest(server.metrics_.registry).decode())
        assert parsed == engine_state(model)
    timing = engine_state(model).timing
    assert timing is not None
    assert (timing.steps, timing.step_tokens) == (steps, tokens)
    assert timing.finished == 4 and timing.preemptions == 0
    assert timing.generation_tokens == sum(len(r.output) for r in requests) == 4 + 5 + 6 + 7
    assert timing.prompt_tokens == sum(len(r.prompt) for r in requests)
    for field, spans in (
        ("queue_s", [(r.arrival, r.scheduled_at) for r in requests]),
        ("prefill_s", [(r.scheduled_at, r.first_token_at) for r in requests]),
        ("decode_s", [(r.first_token_at, r.last_token_at) for r in requests]),
    ):
        expected = sum(b - a for a, b in spans)  # type: ignore[operator]
        assert getattr(timing, field) == pytest.approx(expected), field
    assert timing.queue_s and timing.queue_s > 0  # two of them waited for a sequence slot


def _serve(server: SimServer, output_tokens: int) -> float:
    """Run one 100-token request to its end on the engine's model; the model time it took."""
    model = server.model
    model.add(request("r", [5] * 100, output_tokens, ignore_eos=True))
    now = 0.0
    while model.has_work:
        batch = model.plan(now)
        assert batch is not None
        now += batch.duration
        model.finish(batch, now)
    return now


def test_a_scaled_engine_reports_real_seconds() -> None:
    config = SimConfig(profile(), MODEL, engine_id="e0", time_scale=10.0)
    server = SimServer(config)
    now = _serve(server, 3)
    text = generate_latest(server.metrics_.registry).decode()
    timing = parse_vllm_metrics(text).timing
    assert timing is not None and timing.decode_s == pytest.approx(now / 10 - timing.prefill_s)  # type: ignore[operator]
    assert 'vllm:request_prefill_time_seconds_bucket{engine="e0",le="0.3",model_name="sim-test"} 1.0' in text


def _served_in(config: SimConfig) -> float:
    return _serve(SimServer(config), 8)


def test_an_engine_started_faster_than_its_profile_runs_every_step_in_less_time() -> None:
    base = SimConfig(profile(), MODEL, engine_id="e0")
    fast = SimConfig(profile(), MODEL, engine_id="e0", speed=2.0)
    assert _served_in(fast) == pytest.approx(_served_in(base) / 2)


def test_the_sim_engine_refuses_a_speed_that_is_not_a_positive_number(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gateway.sim.cli import sim_engine_main

    for bad in ("0", "-1", "nan", "inf"):
        assert sim_engine_main(["--speed", bad]) == 2
        assert "--speed must be a finite number > 0" in capsys.readouterr().err


def test_a_slow_fault_is_relative_to_the_engines_own_speed() -> None:
    from gateway.sim.server import _parse_fault_header

    server = SimServer(SimConfig(profile(), MODEL, engine_id="e0", speed=2.0))
    assert server.model.slow_factor == 0.5
    server._apply_faults(_parse_fault_header("slow=3"), request("r", [5] * 4, 1))
    assert server.model.slow_factor == pytest.approx(1.5)  # 3x slower than its own 2x speed
    assert _parse_fault_header(" hang , crash-after=4,") == [("hang", 0.0), ("crash-after", 4.0)]


def test_the_sim_engine_on_a_busy_port_says_so_in_one_line() -> None:
    """It printed a traceback and an unclosed-session warning."""
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.sim.cli", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert line.startswith(f"slogate sim-engine: cannot listen on 127.0.0.1:{port}: "), line
    assert "already in use" in line and "\n" not in line, line


def test_the_sim_engine_refuses_a_bad_port_and_kv_event_endpoint_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A port past 65535 was taken modulo 65536 (70000 listened on 4464, unsaid); a KV-event
    endpoint ZMQ refused (bad, or a port in use) was a traceback."""
    import zmq

    from gateway.sim.cli import sim_engine_main

    with pytest.raises(SystemExit) as exited:
        sim_engine_main(["--port", "70000"])
    assert exited.value.code == 2 and "a port is 0-65535, got 70000" in capsys.readouterr().err
    assert sim_engine_main(["--port", "0", "--kv-events-endpoint", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slogate sim-engine: --kv-events-endpoint bogus: ") and err.count("\n") == 1
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        assert sim_engine_main(["--port", "0", "--kv-events-endpoint", f"tcp://*:{port}"]) == 1
        assert "Address already in use" in capsys.readouterr().err
    finally:
        taken.close(0)
        context.term()
