"""The fleet's capacity for a workload: the throughput its engines sustain when never idle.

Loads in the experiment grid are fractions of this, so "1.2x" means the same overload whatever
the workload, the engine or its speed. Measured on the engine model alone (no gateway, no
policy): the engine is kept saturated, with twice ``max_num_seqs`` requests of the workload
waiting and one more added at each completion, and the completion rate is taken after the first
quarter of the completions, until the refills stop. Neither the start (every seat filled at
once, then a cohort finishing together) nor the drain counts.

(An earlier version timed one fixed backlog of 600 requests between its 10th and 90th
percentile finish times. With 256 seats that is barely two cohorts, and it read 31 % high on the
4-task set and 49 % high on the 2-task set: the grid's "1x" was an overload.)
"""

from __future__ import annotations

import functools

from gateway.experiments.workloads import load_workload
from gateway.sim.engine import SimRequest
from gateway.sim.profiles import load_profile
from gateway.simulator.clock import EventQueue
from gateway.simulator.engine_node import EngineNode
from gateway.simulator.gateway_node import engine_prompt

#: waiting requests kept beside the running ones, in multiples of the engine's ``max_num_seqs``
BACKLOG_SEATS = 2


class _Saturating:
    """Feeds the engine a new request at every completion while any are left; records finishes."""

    def __init__(self, requests: list[SimRequest]) -> None:
        self._requests = requests
        self._next = 0
        self.node: EngineNode | None = None
        self.finished_at: list[float] = []
        #: completions counted when the last request was added (the drain starts after)
        self.fed_at_completion = -1

    def feed(self, count: int) -> None:
        assert self.node is not None
        for _ in range(count):
            if self._next == len(self._requests):
                return
            self.node.add(self._requests[self._next])
            self._next += 1
            if self._next == len(self._requests):
                self.fed_at_completion = len(self.finished_at)

    def on_tokens(self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float) -> None:
        return None

    def on_finished(self, engine_id: str, requests: list[SimRequest], now: float) -> None:
        self.finished_at.extend(now for _ in requests)
        self.feed(len(requests))


@functools.lru_cache(maxsize=64)
def engine_capacity(
    workload: str, engine_profile: str = "qwen-7b", speed: float = 1.0, requests: int = 4000, seed: int = 0
) -> float:
    """Requests per second one engine completes for ``workload`` when it is never short of work.
    Deterministic in its arguments, so measured once per process (a grid asks for each workload
    and speed again in every run of it: 1-2.5 s each time)."""
    profile = load_profile(engine_profile)
    specs = load_workload(workload, qps=1.0, requests=requests, seed=seed)
    backlog = profile.max_num_seqs * (1 + BACKLOG_SEATS)
    if len(specs) < 4 * backlog:
        raise ValueError(
            f"{workload}: {len(specs)} requests are too few to measure a sustained rate "
            f"(at least {4 * backlog}: four times the {backlog} the engine holds and keeps waiting)"
        )
    clock = EventQueue()
    feeder = _Saturating(
        [
            SimRequest(
                f"c{i}",
                engine_prompt(spec),
                spec.output_tokens,
                0.0,
                ignore_eos=True,
                output_len=spec.output_tokens,
            )
            for i, spec in enumerate(specs)
        ]
    )
    feeder.node = EngineNode("capacity", profile, clock, feeder, slow_factor=1.0 / speed, seed=seed)
    feeder.feed(backlog)
    clock.run()
    done = feeder.finished_at
    first, last = len(done) // 4, feeder.fed_at_completion
    if last <= first or done[last] <= done[first]:
        raise ValueError(f"{workload}: the engine finished too few requests to measure a rate")
    return (last - first) / (done[last] - done[first])
