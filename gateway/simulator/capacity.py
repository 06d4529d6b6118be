"""The fleet's capacity for a workload: the throughput its engines sustain when never idle.

Loads in the experiment grid are fractions of this, so "1.2x" means the same overload whatever
the workload, the engine or its speed. Measured on the engine model alone (no gateway, no
policy): every engine starts with the same backlog of the workload's requests and the rate of
completions between the 10th and the 90th percentile of finish times is taken, so neither the
ramp-up nor the drain at the end counts.
"""

from __future__ import annotations

from gateway.experiments.workloads import load_workload
from gateway.sim.engine import SimRequest
from gateway.sim.profiles import load_profile
from gateway.simulator.clock import EventQueue
from gateway.simulator.engine_node import EngineNode
from gateway.simulator.gateway_node import engine_prompt


class _Finishes:
    def __init__(self) -> None:
        self.at: list[float] = []

    def on_tokens(self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float) -> None:
        return None

    def on_finished(self, engine_id: str, requests: list[SimRequest], now: float) -> None:
        self.at.extend(now for _ in requests)


def engine_capacity(
    workload: str, engine_profile: str = "qwen-7b", speed: float = 1.0, requests: int = 600, seed: int = 0
) -> float:
    """Requests per second one engine completes for ``workload`` when it is never short of work."""
    specs = load_workload(workload, qps=1.0, requests=requests, seed=seed)
    clock = EventQueue()
    finishes = _Finishes()
    node = EngineNode(
        "capacity", load_profile(engine_profile), clock, finishes, slow_factor=1.0 / speed, seed=seed
    )
    for i, spec in enumerate(specs):
        node.add(
            SimRequest(
                f"c{i}",
                engine_prompt(spec),
                spec.output_tokens,
                0.0,
                ignore_eos=True,
                output_len=spec.output_tokens,
            )
        )
    clock.run()
    done = sorted(finishes.at)
    lo, hi = done[len(done) // 10], done[(9 * len(done)) // 10]
    if hi <= lo:
        raise ValueError(f"{workload}: too few requests to measure a rate ({len(done)})")
    return (9 * len(done) // 10 - len(done) // 10) / (hi - lo)
