"""``slogate bench prefix-memory``: the prefix index's memory against its bound, at a million blocks.

The index (:mod:`gateway.fleet.prefix_index`) counts its own bytes and evicts whole generations to
stay under ``prefix_index_budget``. This fills fresh indexes with distinct blocks and measures
what Python really allocated for each with ``tracemalloc`` (the peak included: transients of the
fill and of evictions count), at checkpoints along the way:

- **dispatches**: prompts recorded as the dispatcher records them (the approximate feed), 64
  blocks a prompt, round robin over 4 engines, past the budget;
- **events**: the same blocks reported by engines' ``BlockStored`` events (the precise feed, with
  the engine's own hashes and the token ids, which the index re-hashes), past the budget;
- **held**: dispatched blocks into a budget with room for all of them: what a block costs.

Checks: what was measured never exceeds what the index counted (its count is an upper bound),
the count never exceeds the budget, the peak stays under it, and every engine keeps a share.
Figures before this: 1,000,000 distinct blocks into 64 MiB, 60.5 MiB measured from dispatches,
59.5 MiB from events; 69.1 MiB for a million held.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gateway.bench.harness import checks_table, progress
from gateway.experiments.plotting import pyplot
from gateway.fleet.block_hash import PromptBlocks, root_key
from gateway.fleet.prefix_index import PrefixIndex
from gateway.report_json import report_json

BLOCK_SIZE = 16
BLOCKS_PER_PROMPT = 64
ENGINES = ("e0", "e1", "e2", "e3")
MIB = 1 << 20
#: the budget of the "held" case: room for every block
ROOM = 1 << 31


@dataclass
class Checkpoint:
    blocks: int
    measured_mib: float
    counted_mib: float
    entries: int


@dataclass
class MemoryCase:
    feed: str
    blocks: int
    budget_mib: float
    measured_mib: float
    peak_mib: float
    counted_mib: float
    entries: int
    evicted: int
    #: the engine keeping least: its part of what is kept (an even split is 1 / engines)
    min_engine_share: float
    wall_s: float
    curve: list[Checkpoint] = field(default_factory=list)

    @property
    def bytes_per_entry(self) -> float:
        return self.measured_mib * MIB / max(1, self.entries)

    def checks(self) -> list[tuple[str, str, str, bool]]:
        name = f"{self.feed}: {self.blocks:,} blocks"
        rows = [
            (
                f"{name}, measured within the index's own count",
                f"{self.measured_mib:.1f} MiB measured, {self.counted_mib:.1f} counted",
                "measured <= counted",
                self.measured_mib <= self.counted_mib,
            )
        ]
        if self.feed == "held":
            rows.append(
                (
                    f"{name} held with room",
                    f"{self.entries:,} kept, {self.bytes_per_entry:.0f} B each",
                    "all kept, none evicted",
                    self.entries == self.blocks and self.evicted == 0,
                )
            )
            return rows
        rows += [
            (
                f"{name} into {self.budget_mib:.0f} MiB: the count",
                f"{self.counted_mib:.1f} MiB",
                f"<= {self.budget_mib:.0f} MiB",
                self.counted_mib <= self.budget_mib,
            ),
            (
                f"{name} into {self.budget_mib:.0f} MiB: the peak (fill and evictions included)",
                f"{self.peak_mib:.1f} MiB",
                f"<= {self.budget_mib:.0f} MiB",
                self.peak_mib <= self.budget_mib,
            ),
            (
                f"{name}: the budget was overflowed and every engine kept a share",
                f"{self.entries:,} kept ({self.evicted:,} evicted), the least engine holds "
                f"{self.min_engine_share:.0%} of them",
                f"evictions; each of {len(ENGINES)} engines > 20 %",
                self.evicted > 0 and self.entries < self.blocks and self.min_engine_share > 0.2,
            ),
        ]
        return rows


def fill(
    index: PrefixIndex, engines: tuple[str, ...], blocks: int, feed: str, rng: np.random.Generator, start: int
) -> None:
    """``blocks`` blocks, new ones while ``rng`` goes on (``start``: prompts filled before, whose
    times and engines the fill carries on from)."""
    root = root_key("m")
    for i in range(start, start + blocks // BLOCKS_PER_PROMPT):
        tokens = rng.integers(0, 152_000, size=BLOCKS_PER_PROMPT * BLOCK_SIZE, dtype=np.uint64)
        engine = engines[i % len(engines)]
        if feed == "events":
            hashes = rng.integers(0, 1 << 63, size=BLOCKS_PER_PROMPT, dtype=np.uint64).tolist()
            index.stored(engine, hashes, None, tokens.tolist(), BLOCK_SIZE, float(i))
        else:
            index.record_dispatch(engine, PromptBlocks(tokens, root), float(i))


def _index(budget: int, engines: tuple[str, ...]) -> PrefixIndex:
    index = PrefixIndex(budget, 1e12)  # (no TTL: the fill's made-up times would expire entries)
    for engine in engines:
        index.add_engine(engine, "m", BLOCK_SIZE)
    return index


def run_case(feed: str, blocks: int, budget: int, checkpoints: int = 10, seed: int = 0) -> MemoryCase:
    """One fresh index filled with ``blocks`` distinct blocks by ``feed`` (dispatches, events, or
    held: dispatches into ``budget`` with room), measured under tracemalloc."""
    if feed not in ("dispatches", "events", "held"):
        raise ValueError(f"unknown feed {feed!r}: dispatches, events or held")
    if blocks < BLOCKS_PER_PROMPT * len(ENGINES) or blocks % BLOCKS_PER_PROMPT:
        raise ValueError(
            f"blocks go {BLOCKS_PER_PROMPT} to a prompt: a multiple of {BLOCKS_PER_PROMPT} and at least "
            f"{BLOCKS_PER_PROMPT * len(ENGINES)}, got {blocks}"
        )
    engines = ENGINES[:1] if feed == "held" else ENGINES
    way = "events" if feed == "events" else "dispatches"
    # what numpy and the index allocate once, on first use, is not the index's: a throwaway fill
    # first, past its own small budget (evictions too)
    warm_up = np.random.default_rng(seed + 1)
    fill(_index(32 << 10, ENGINES[:1]), ENGINES[:1], 20 * BLOCKS_PER_PROMPT, way, warm_up, 0)
    rng = np.random.default_rng(seed)
    step = max(BLOCKS_PER_PROMPT, blocks // checkpoints // BLOCKS_PER_PROMPT * BLOCKS_PER_PROMPT)
    curve: list[Checkpoint] = []
    started = time.perf_counter()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        index = _index(budget, engines)
        done = 0
        while done < blocks:
            n = min(step, blocks - done)
            fill(index, engines, n, way, rng, done // BLOCKS_PER_PROMPT)
            done += n
            measured = (tracemalloc.get_traced_memory()[0] - base) / MIB
            curve.append(Checkpoint(done, measured, index.bytes_used / MIB, index.entries()))
            progress(
                f"prefix-memory {feed}: {done:,} of {blocks:,} blocks, {measured:.1f} MiB measured, "
                f"{index.bytes_used / MIB:.1f} counted, {index.entries():,} kept"
            )
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    entries = index.entries()
    return MemoryCase(
        feed=feed,
        blocks=blocks,
        budget_mib=budget / MIB,
        measured_mib=(current - base) / MIB,
        peak_mib=(peak - base) / MIB,
        counted_mib=index.bytes_used / MIB,
        entries=entries,
        evicted=index.stats.evicted,
        min_engine_share=min(index.entries(e) for e in engines) / max(1, entries),
        wall_s=time.perf_counter() - started,
        curve=curve,
    )


def render_table(cases: list[MemoryCase]) -> str:
    lines = [
        "| feed | blocks | budget (MiB) | measured (MiB) | peak (MiB) | counted (MiB) | kept "
        "| B per kept block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        budget = "room" if c.feed == "held" else f"{c.budget_mib:.0f}"
        lines.append(
            f"| {c.feed} | {c.blocks:,} | {budget} | {c.measured_mib:.1f} | {c.peak_mib:.1f} | "
            f"{c.counted_mib:.1f} | {c.entries:,} | {c.bytes_per_entry:.0f} |"
        )
    return "\n".join(lines)


def plot(cases: list[MemoryCase], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for case in cases:
        xs = [p.blocks for p in case.curve]
        (line,) = ax.plot(
            xs, [p.measured_mib for p in case.curve], marker="o", label=f"{case.feed}: measured"
        )
        ax.plot(
            xs,
            [p.counted_mib for p in case.curve],
            linestyle="--",
            color=line.get_color(),
            label=f"{case.feed}: counted",
        )
    budgets = {c.budget_mib for c in cases if c.feed != "held"}
    for budget in budgets:
        ax.axhline(budget, color="grey", linestyle=":", label=f"budget {budget:.0f} MiB")
    ax.set_xlabel("distinct blocks filled")
    ax.set_ylabel("MiB (tracemalloc / the index's count)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_prefix_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks per case")
    parser.add_argument(
        "--budget-mib", type=float, default=64.0, help="the index's budget when filled past it"
    )
    parser.add_argument("--feeds", default="dispatches,events,held", help="cases: dispatches, events, held")
    parser.add_argument("--checkpoints", type=int, default=10, help="measurements along each fill")
    parser.add_argument("--out", type=Path, default=Path("results/bench-prefix-memory"))


def bench_prefix_memory_main(args: argparse.Namespace) -> int:
    budget = int(args.budget_mib * MIB)
    cases = []
    try:
        for feed in [f.strip() for f in args.feeds.split(",") if f.strip()]:
            cases.append(run_case(feed, args.blocks, ROOM if feed == "held" else budget, args.checkpoints))
    except ValueError as error:
        print(f"slogate bench prefix-memory: {error}", file=sys.stderr)
        return 2
    table = render_table(cases)
    checks = [row for case in cases for row in case.checks()]
    print(table)
    print()
    print("\n".join(checks_table(checks)))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n\n" + "\n".join(checks_table(checks)) + "\n")
    (out / "cases.json").write_text(report_json([asdict(c) for c in cases], indent=1))
    plot(cases, out / "prefix_memory.png")
    print(f"wrote {out / 'table.md'}, {out / 'cases.json'}, {out / 'prefix_memory.png'}")
    return 0 if all(ok for *_, ok in checks) else 1
