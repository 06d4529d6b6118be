"""Micro-benchmark of the admission queue: µs per push / pop / peek at 10,000 items, per order.

Run: ``python -m loadtest.queue_bench [--items 10000] [--seed 1]``. Prints one line per order and
asserts nothing (timings depend on the machine); ``tests/policies/test_admission_queue.py`` runs it
at a tiny size as a smoke test.

The workload is a burst of requests that arrived over the last ``items * 0.5 ms`` with mixed prompt
lengths (1..4000 tokens), priorities (0..3) and TTFT targets (0.5/1/2 s), then drained at one
instant, so time-dependent orders see a realistic mix of young, aged, feasible and late requests.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from policies.admission_queue import AdmissionQueue
from policies.api import RequestView
from policies.queue_order import ORDERS, OrderContext, QueuedRequest, make_order


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Mean cost per operation in microseconds for one order."""

    order: str
    items: int
    push_us: float
    peek_us: float
    pop_us: float


def make_items(count: int, seed: int) -> list[QueuedRequest]:
    """``count`` literal requests arriving 0.5 ms apart (arrival 0 .. count * 0.5 ms)."""
    rng = random.Random(seed)
    return [
        QueuedRequest(
            view=RequestView(
                request_id=f"req-{i}",
                model="bench",
                prompt_tokens=rng.randint(1, 4000),
                max_output_tokens=256,
                arrival=i * 0.0005,
                priority=rng.randint(0, 3),
            ),
            ttft_slo=rng.choice((0.5, 1.0, 2.0)),
            tpot_slo=0.05,
            seq=i,
        )
        for i in range(count)
    ]


def bench_order(name: str, items: list[QueuedRequest], peeks: int = 1000) -> BenchResult:
    """Push every item, peek ``peeks`` times, then pop everything; all at one ``now``."""
    ctx = OrderContext(prefill_tokens_per_s=20_000.0, decode_step_s=0.02, prefill_engines=8)
    queue = AdmissionQueue(make_order(name))
    now = items[-1].view.arrival if items else 0.0
    start = time.perf_counter()
    for item in items:
        queue.push(item, now, ctx)
    pushed = time.perf_counter()
    for _ in range(peeks):
        queue.peek(now, ctx)
    peeked = time.perf_counter()
    popped_count = 0
    while queue.pop(now, ctx) is not None:
        popped_count += 1
    done = time.perf_counter()
    count = max(1, len(items))
    return BenchResult(
        order=name,
        items=popped_count,
        push_us=(pushed - start) / count * 1e6,
        peek_us=(peeked - pushed) / max(1, peeks) * 1e6,
        pop_us=(done - peeked) / count * 1e6,
    )


def run(count: int = 10_000, seed: int = 1, peeks: int = 1000) -> list[BenchResult]:
    """One :class:`BenchResult` per registered order, printed as a table."""
    items = make_items(count, seed)
    results = [bench_order(name, items, peeks) for name in ORDERS]
    print(f"{'order':<16} {'items':>7} {'push µs':>9} {'peek µs':>9} {'pop µs':>9}")
    for r in results:
        print(f"{r.order:<16} {r.items:>7} {r.push_us:>9.2f} {r.peek_us:>9.2f} {r.pop_us:>9.2f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--peeks", type=int, default=1000)
    args = parser.parse_args()
    run(args.items, args.seed, args.peeks)


if __name__ == "__main__":
    main()
