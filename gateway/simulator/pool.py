"""Independent simulator runs on every core, with a progress line as each one ends."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

R = TypeVar("R")


def run_jobs(
    run: Callable[..., R],
    jobs: Sequence[tuple[Any, ...]],
    workers: int,
    done: Callable[[int, tuple[Any, ...], R], None],
) -> list[R]:
    """``run(*job)`` for every job in at most ``workers`` processes (``run`` must be picklable: a
    module-level function); ``done(count, job, result)`` is called in this process as each ends.
    Results come back in completion order."""
    results: list[R] = []
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
        futures = {pool.submit(run, *job): job for job in jobs}
        for count, future in enumerate(as_completed(futures), start=1):
            result = future.result()
            results.append(result)
            done(count, futures[future], result)
    return results
