"""Workload definitions and the generators that turn them into seeded request lists.

Three shapes (:attr:`Workload.kind`):

- ``mix``: one arrival stream at ``qps``; the tasks share its arrivals in proportion to their
  weights, exactly (a shuffled quota, as HyperFlexis draws an equal number of samples per task).
  One stream rather than one per task keeps a bursty process bursty: superposing independent
  Gamma streams drifts back towards Poisson.
- ``ramp``: HyperFlexis Fig. 6. One client per task at ``qps / len(tasks)`` each; the lowest
  priority (largest number) starts at 0 and each next level joins ``join_every_s`` later, so the
  total reaches ``qps`` once all have joined.
- ``multi-turn``: conversations. Sessions start on the arrival process; each turn's prompt is the
  session's system prompt, every earlier turn (user message, then the reply's tokens) and the new
  user message, so a turn's prompt begins with the whole of the previous turn's prompt. The next
  turn comes a think time (exponential) after the previous one was *sent*: the workload is open
  loop and fixed in advance, whatever the system under test does. Sessions start at
  ``qps / mean turns per session``, so turns arrive at about ``qps``.

Every random choice comes from its own stream (:func:`~gateway.experiments.prompts.derive_seed`
of the seed and a purpose), so changing a length distribution leaves the arrival times alone and
two workloads with the same arrival process and seed arrive at the same times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.experiments.arrivals import ArrivalProcess, Poisson, arrival_times
from gateway.experiments.lengths import Fixed, LengthDist, Normal
from gateway.experiments.prompts import derive_seed
from gateway.experiments.workload import RequestSpec, TaskSpec

Kind = Literal["mix", "ramp", "multi-turn"]
KINDS: tuple[Kind, ...] = ("mix", "ramp", "multi-turn")
#: sessions sampled to estimate the mean turns per session (and so the session start rate)
_TURN_ESTIMATE_SESSIONS = 2000


@dataclass(frozen=True, slots=True)
class Task:
    """One request class: SLO targets, priority, share of the arrivals and length distributions.

    ``prefix_tokens`` > 0 starts every prompt of the task with the same segment of that many tokens
    (a shared system prompt or few-shot template) before the sampled ``input`` length.
    """

    name: str
    ttft_s: float
    tpot_s: float
    input: LengthDist
    output: LengthDist
    priority: int = 0
    weight: float = 1.0
    prefix_tokens: int = 0

    @classmethod
    def from_spec(cls, spec: TaskSpec, max_prompt: int = 3500, max_output: int = 1500) -> Task:
        """A Table-1 style :class:`TaskSpec` (normal lengths, the old clips) as a task."""
        return cls(
            spec.name,
            spec.ttft_s,
            spec.tpot_s,
            Normal(spec.input_mean, spec.input_std, hi=max_prompt),
            Normal(spec.output_mean, spec.output_std, hi=max_output),
            spec.priority,
        )


@dataclass(frozen=True, slots=True)
class Sessions:
    """The conversation shape of a multi-turn workload; a task's ``input`` is one user message."""

    turns: LengthDist
    think_time_s: float
    system_tokens: LengthDist = field(default_factory=lambda: Fixed(0, lo=0, hi=0))
    #: distinct system prompts; each session uses one, chosen at random (prefix groups)
    system_prompts: int = 1
    #: a session ends before a turn whose prompt would exceed this
    max_prompt_tokens: int = 8192


@dataclass(frozen=True, slots=True)
class Workload:
    """A named workload; ``requests`` / ``duration_s`` are the defaults :meth:`generate` uses when
    the caller gives neither."""

    name: str
    tasks: tuple[Task, ...]
    arrivals: ArrivalProcess = field(default_factory=Poisson)
    kind: Kind = "mix"
    join_every_s: float = 0.0
    sessions: Sessions | None = None
    requests: int | None = None
    duration_s: float | None = None
    description: str = ""

    def generate(
        self, *, qps: float, requests: int | None = None, duration_s: float | None = None, seed: int = 0
    ) -> list[RequestSpec]:
        """Requests sorted by arrival time: the first ``requests`` of them, or those arriving
        before ``duration_s``, or whichever ends first when both are given."""
        if requests is None and duration_s is None:
            requests, duration_s = self.requests, self.duration_s
            if requests is None and duration_s is None:
                raise ValueError(f"workload {self.name}: give requests or duration_s (it sets no default)")
        if not (qps > 0 and math.isfinite(qps)):
            raise ValueError(f"workload {self.name}: qps must be a positive number, got {qps!r}")
        if self.kind == "mix":
            return mix_workload(
                self.tasks, self.arrivals, qps, requests=requests, duration_s=duration_s, seed=seed
            )
        if self.kind == "ramp":
            return ramp_workload(
                self.tasks,
                self.arrivals,
                qps,
                self.join_every_s,
                requests=requests,
                duration_s=duration_s,
                seed=seed,
            )
        if self.sessions is None:
            raise ValueError(f"workload {self.name}: a multi-turn workload needs sessions")
        return multi_turn_workload(
            self.tasks, self.arrivals, self.sessions, qps, requests=requests, duration_s=duration_s, seed=seed
        )


def mix_workload(
    tasks: Sequence[Task],
    arrivals: ArrivalProcess,
    qps: float,
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """``kind: mix``: one stream at ``qps``, tasks sharing it by weight (module docstring)."""
    times = arrival_times(
        arrivals, random.Random(derive_seed(seed, "arrivals")), qps, count=requests, until=duration_s
    )
    order = _quota(tasks, len(times), random.Random(derive_seed(seed, "tasks")))
    rng = random.Random(derive_seed(seed, "lengths"))
    return [_single(task, at, rng, seed, i) for i, (at, task) in enumerate(zip(times, order, strict=True))]


def ramp_workload(
    tasks: Sequence[Task],
    arrivals: ArrivalProcess,
    qps: float,
    join_every_s: float,
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """``kind: ramp``: a client per task at ``qps / len(tasks)``, joining lowest priority first."""
    levels = sorted({t.priority for t in tasks}, reverse=True)
    joins = {priority: rank * join_every_s for rank, priority in enumerate(levels)}
    rate = qps / len(tasks)
    out: list[RequestSpec] = []
    for task in tasks:
        times = arrival_times(
            arrivals,
            random.Random(derive_seed(seed, "arrivals", task.name)),
            rate,
            count=requests,
            until=duration_s,
            start=joins[task.priority],
        )
        rng = random.Random(derive_seed(seed, "lengths", task.name))
        out.extend(_single(task, at, rng, seed, i) for i, at in enumerate(times))
    out.sort(key=lambda r: r.at)
    return out[:requests] if requests is not None else out


def multi_turn_workload(
    tasks: Sequence[Task],
    arrivals: ArrivalProcess,
    sessions: Sessions,
    qps: float,
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """``kind: multi-turn``: sessions whose turns re-send the conversation so far (module docstring)."""
    if requests is None and duration_s is None:
        raise ValueError("multi_turn_workload: give requests, duration_s or both")
    if any(t.prefix_tokens for t in tasks):
        raise ValueError("multi_turn_workload: tasks cannot have prefix_tokens (use the system prompt)")
    if sessions.system_tokens.hi >= sessions.max_prompt_tokens:
        raise ValueError("multi_turn_workload: system prompts must be shorter than max_prompt_tokens")
    systems = [
        (
            derive_seed(seed, "system", k),
            sessions.system_tokens.sample(random.Random(derive_seed(seed, "system-length", k))),
        )
        for k in range(sessions.system_prompts)
    ]
    estimate = random.Random(derive_seed(seed, "turn-estimate"))
    mean_turns = (
        sum(
            len(_session(tasks, sessions, systems, estimate, seed, f"estimate{i}", 0.0))
            for i in range(_TURN_ESTIMATE_SESSIONS)
        )
        / _TURN_ESTIMATE_SESSIONS
    )
    gaps = arrivals.gaps(random.Random(derive_seed(seed, "arrivals")), qps / max(mean_turns, 1e-9))
    out: list[RequestSpec] = []
    # With a request count, sessions keep starting until one starts after the count-th earliest
    # turn so far: a later session only adds turns after that, so it cannot enter the first N.
    horizon = math.inf
    start = 0.0
    index = 0
    while True:
        start += next(gaps)
        if duration_s is not None and start >= duration_s:
            break
        if requests is not None and len(out) >= requests:
            if horizon == math.inf:
                horizon = sorted(r.at for r in out)[requests - 1]
            if start > horizon:
                break
        rng = random.Random(derive_seed(seed, "session", index))
        out.extend(_session(tasks, sessions, systems, rng, seed, f"s{index}", start))
        index += 1
    if duration_s is not None:
        out = [r for r in out if r.at < duration_s]
    out.sort(key=lambda r: r.at)
    return out[:requests] if requests is not None else out


def _single(task: Task, at: float, rng: random.Random, seed: int, index: int) -> RequestSpec:
    body = task.input.sample(rng)
    output = task.output.sample(rng)
    segments: tuple[tuple[int, int], ...] = ((derive_seed(seed, "prompt", task.name, index), body),)
    if task.prefix_tokens:
        segments = ((derive_seed(seed, "prefix", task.name), task.prefix_tokens), *segments)
    return RequestSpec(
        at=at,
        task=task.name,
        priority=task.priority,
        prompt_tokens=task.prefix_tokens + body,
        output_tokens=output,
        ttft_s=task.ttft_s,
        tpot_s=task.tpot_s,
        segments=segments,
    )


def _session(
    tasks: Sequence[Task],
    sessions: Sessions,
    systems: Sequence[tuple[int, int]],
    rng: random.Random,
    seed: int,
    session: str,
    start: float,
) -> list[RequestSpec]:
    task = rng.choices(tasks, weights=[t.weight for t in tasks])[0]
    system = systems[rng.randrange(len(systems))]
    history: tuple[tuple[int, int], ...] = (system,) if system[1] else ()
    total = system[1]
    at = start
    out: list[RequestSpec] = []
    for turn in range(sessions.turns.sample(rng)):
        user = task.input.sample(rng)
        output = task.output.sample(rng)
        if turn == 0:
            user = min(user, sessions.max_prompt_tokens - total)
        elif total + user > sessions.max_prompt_tokens:
            break
        else:
            at += rng.expovariate(1.0 / sessions.think_time_s)
        segments = (*history, (derive_seed(seed, session, turn, "user"), user))
        out.append(
            RequestSpec(
                at=at,
                task=task.name,
                priority=task.priority,
                prompt_tokens=total + user,
                output_tokens=output,
                ttft_s=task.ttft_s,
                tpot_s=task.tpot_s,
                session=session,
                turn=turn,
                segments=segments,
            )
        )
        # the reply becomes history as tokens of its own: a simulator need not know what the
        # engine generated, and a live client re-sends these, not the engine's words
        history = (*segments, (derive_seed(seed, session, turn, "assistant"), output))
        total += user + output
    return out


def _quota(tasks: Sequence[Task], n: int, rng: random.Random) -> list[Task]:
    """``n`` tasks in proportion to their weights (largest remainder), in random order."""
    total = sum(t.weight for t in tasks)
    shares = [n * t.weight / total for t in tasks]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(tasks)), key=lambda i: counts[i] - shares[i])
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    order = [task for task, count in zip(tasks, counts, strict=True) for _ in range(count)]
    rng.shuffle(order)
    return order
