"""Synthetic multi-SLO workloads for experiments: tasks, Poisson arrivals, length distributions.

Lengths follow the per-task mean ± std of HyperFlexis Table 1 (normal, clipped to >= 1);
arrivals are Poisson per task. Prompts are made of three-letter words, which the shared
tokenizer counts as one token each, so the engine sees the intended prompt length.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TaskSpec:
    name: str
    ttft_s: float
    tpot_s: float
    input_mean: float
    input_std: float
    output_mean: float
    output_std: float
    priority: int = 0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload; ``at`` is seconds after the start, in simulated time.

    ``segments`` lists the prompt as ``(seed, length)`` pieces whose lengths sum to
    ``prompt_tokens``; :func:`gateway.experiments.prompts.prompt_token_ids` turns them into token
    ids, equal wherever two prompts list the same leading pieces. Empty means "no shared prefix"
    (the ids then derive from the spec itself). ``session`` and ``turn`` tell a multi-turn
    conversation's requests apart (turn 0 first); single-shot requests have no session.
    """

    at: float
    task: str
    priority: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    session: str | None = None
    turn: int = 0
    segments: tuple[tuple[int, int], ...] = ()
    #: the output bound the client sends (``max_tokens``); None: exactly ``output_tokens``, as
    #: if the client knew its answer's length (see :func:`with_task_bounds`)
    max_tokens: int | None = None

    @property
    def bound(self) -> int:
        """What the gateway and its policies know of the output: the client's bound."""
        return self.output_tokens if self.max_tokens is None else self.max_tokens


#: what ``--output-bound`` takes: ``exact`` (the client sends each answer's own length) or
#: ``task-p99`` (the 99th percentile of its task's lengths: a bound an application sets from
#: what its answers measure, the longer ones cut there)
OUTPUT_BOUNDS = ("exact", "task-p99")


def with_task_bounds(specs: Sequence[RequestSpec], quantile: float = 0.99) -> list[RequestSpec]:
    """``specs`` with each request's ``max_tokens`` set to its task's ``quantile`` of output
    lengths (nearest rank): what the dispatcher may know of a request's output is then what a
    client knows, a bound per kind of request, not the exact length of each answer."""
    from gateway.experiments.replay import percentile  # (replay reads this module's specs)

    lengths: dict[str, list[float]] = {}
    for spec in specs:
        lengths.setdefault(spec.task, []).append(spec.output_tokens)
    bound = {task: int(percentile(values, quantile)) for task, values in lengths.items()}
    return [dataclasses.replace(spec, max_tokens=bound[spec.task]) for spec in specs]


# HyperFlexis Table 1 (TTFT s, TPOT s, input mean ± std, output mean ± std).
HYPERFLEXIS_4TASK = (
    TaskSpec("medical_qa", 0.7, 0.5, 32.57, 10.32, 38.92, 16.83),
    TaskSpec("tldr_content_gen", 1.0, 0.7, 44.38, 6.58, 96.04, 35.03),
    TaskSpec("tldr_headline_gen", 2.0, 0.9, 121.82, 35.04, 13.59, 6.55),
    TaskSpec("wikisql", 20.0, 1.0, 643.22, 337.01, 27.82, 4.84),
)
HYPERFLEXIS_2TASK = (
    TaskSpec("gsm8k", 0.7, 0.2, 51.44, 15.78, 90.13, 26.73),
    TaskSpec("sharegpt", 2.0, 0.5, 259.19, 324.88, 207.79, 234.99),
)

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _length(rng: random.Random, mean: float, std: float, cap: int) -> int:
    return max(1, min(cap, round(rng.gauss(mean, std))))


def poisson_workload(
    tasks: Sequence[TaskSpec],
    qps: float,
    per_task: int,
    seed: int = 0,
    max_prompt: int = 3500,
    max_output: int = 1500,
) -> list[RequestSpec]:
    """``per_task`` requests of each task; the total arrival rate is ``qps`` split evenly."""
    rng = random.Random(seed)
    rate = qps / len(tasks)
    out: list[RequestSpec] = []
    for task in tasks:
        t = 0.0
        for _ in range(per_task):
            t += rng.expovariate(rate)
            out.append(
                RequestSpec(
                    at=t,
                    task=task.name,
                    priority=task.priority,
                    prompt_tokens=_length(rng, task.input_mean, task.input_std, max_prompt),
                    output_tokens=_length(rng, task.output_mean, task.output_std, max_output),
                    ttft_s=task.ttft_s,
                    tpot_s=task.tpot_s,
                )
            )
    out.sort(key=lambda r: r.at)
    return out


def prompt_text(tokens: int, rng: random.Random) -> str:
    """Text of about ``tokens`` tokens: space-separated three-letter words (one token each)."""
    letters = _LETTERS
    return "".join(
        " " + rng.choice(letters) + rng.choice(letters) + rng.choice(letters) for _ in range(tokens)
    )


def priority_ramp(
    tasks: Sequence[TaskSpec],
    qps_per_client: float,
    join_every_s: float,
    duration_s: float,
    seed: int = 0,
) -> list[RequestSpec]:
    """HyperFlexis Fig. 6: the lowest priority starts alone; each join_every_s another client
    with the next higher priority joins at the same rate, until all run. ``tasks`` are given
    from priority 0 (highest) down; task i is sent with priority i."""
    rng = random.Random(seed)
    out: list[RequestSpec] = []
    levels = len(tasks)
    for priority, task in enumerate(tasks):
        t = (levels - 1 - priority) * join_every_s
        while True:
            t += rng.expovariate(qps_per_client)
            if t >= duration_s:
                break
            out.append(
                RequestSpec(
                    at=t,
                    task=task.name,
                    priority=priority,
                    prompt_tokens=_length(rng, task.input_mean, task.input_std, 3500),
                    output_tokens=_length(rng, task.output_mean, task.output_std, 1500),
                    ttft_s=task.ttft_s,
                    tpot_s=task.tpot_s,
                )
            )
    out.sort(key=lambda r: r.at)
    return out
