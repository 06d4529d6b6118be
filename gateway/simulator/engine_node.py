"""One simulated engine in virtual time: the simulated engine's own model, stepped by the clock.

The live simulated engine (``gateway/sim/server.py``) plans a batch, sleeps its duration, applies
it and plans the next; this node does the same on the virtual clock, so both run one engine model
step for step. Tokens and completions go to a listener (the simulated gateway) at the step's end.
"""

from __future__ import annotations

import math
from typing import Protocol

from gateway.sim.engine import Batch, EngineModel, SimRequest
from gateway.sim.metrics import engine_state
from gateway.sim.profiles import EngineProfile
from gateway.simulator.clock import EventQueue
from policies.api import EngineState


class EngineListener(Protocol):
    def on_tokens(self, engine_id: str, tokens: list[tuple[SimRequest, int]], now: float) -> None: ...

    def on_finished(self, engine_id: str, requests: list[SimRequest], now: float) -> None: ...


class EngineNode:
    def __init__(
        self,
        engine_id: str,
        profile: EngineProfile,
        clock: EventQueue,
        listener: EngineListener,
        *,
        priority_scheduling: bool = False,
        slow_factor: float = 1.0,
        seed: int = 0,
    ) -> None:
        """``slow_factor``: every step takes this many times what the profile says (an engine
        slower or faster than the prior the gateway was given)."""
        self.engine_id = engine_id
        self.model = EngineModel(
            profile, priority_scheduling=priority_scheduling, slow_factor=slow_factor, seed=seed
        )
        self.clock = clock
        self.listener = listener
        self._stepping = False  # a step is in flight (its end is scheduled)
        self._transfer_wake = math.inf
        #: virtual seconds this engine spent running steps
        self.busy_s = 0.0
        self.steps = 0

    def add(self, request: SimRequest) -> None:
        self.model.add(request)
        if not self._stepping:
            self._step()

    def release_held(self, request_id: str) -> None:
        """The KV this prefill engine held for a request is free (its transfer ended, or it was
        dropped): requests waiting for room may now be planned, so an idle engine steps again
        (nothing else would wake it: its held KV had stopped it, not a lack of work)."""
        self.model.release_held(request_id)
        if not self._stepping:
            self._step()

    def state(self) -> EngineState:
        """What a scrape of this engine's ``/metrics`` would tell the gateway now."""
        return engine_state(self.model)

    def _step(self) -> None:
        now = self.clock.now
        batch = self.model.plan(now) if self.model.has_work else None
        if batch is None:
            self._stepping = False
            ready = self.model.next_transfer_at() if self.model.has_work else math.inf
            if ready != math.inf and ready < self._transfer_wake:
                # requests waiting for KV from elsewhere become schedulable then
                self._transfer_wake = ready
                self.clock.at(ready, self._wake_for_transfer)
            return
        self._stepping = True
        self.clock.at(now + batch.duration, self._finish, batch)

    def _wake_for_transfer(self) -> None:
        self._transfer_wake = math.inf
        if not self._stepping:
            self._step()

    def _finish(self, batch: Batch) -> None:
        now = self.clock.now
        # (counted as it ends: a step still running when the run stops did not run, and counted
        # as it began, an engine's busy share could pass 100 %)
        self.steps += 1
        self.busy_s += batch.duration
        result = self.model.finish(batch, now)
        if result.tokens:
            self.listener.on_tokens(self.engine_id, result.tokens, now)
        if result.finished:
            self.listener.on_finished(self.engine_id, result.finished, now)
        self._step()
