"""``slogate``: the command-line entry point.

Subcommands: ``serve`` (the gateway), ``up`` (gateway + simulated engines on one machine),
``sim-engine`` (one simulated vLLM-compatible engine), ``real-engine`` (provision and run real
vLLM / llama.cpp locally) and ``bench`` (benchmarks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from gateway.settings import load_settings_or_exit

    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    settings = load_settings_or_exit(args.config, **overrides)
    serve(settings)
    return 0


def _up(args: argparse.Namespace) -> int:
    from gateway.up import run_up

    return run_up(args)


def _experiment(args: argparse.Namespace) -> int:
    if args.experiment == "priority-ramp":
        from gateway.experiments.priority_ramp import ramp_main

        return ramp_main(args)
    if args.experiment == "grid":
        from gateway.simulator.grid import grid_main

        return grid_main(args)
    if args.experiment == "pd":
        from gateway.simulator.pd_experiment import pd_main

        return pd_main(args)
    if args.experiment == "prefix":
        from gateway.simulator.prefix_experiment import prefix_main

        return prefix_main(args)
    if args.experiment == "autoscale":
        from gateway.simulator.autoscale_experiment import autoscale_main

        return autoscale_main(args)
    if args.experiment == "migration":
        from gateway.experiments.migration import migration_main

        return migration_main(args)
    from gateway.experiments.runner import experiment_main

    return experiment_main(args)


def _simulate(args: argparse.Namespace) -> int:
    from gateway.simulator.cli import simulate_main

    return simulate_main(args)


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "large-body":
        from gateway.bench.large_body import bench_large_body_main

        return bench_large_body_main(args)
    if args.bench == "dispatch":
        from gateway.bench.dispatch import bench_dispatch_main

        return bench_dispatch_main(args)
    if args.bench == "dispatchers":
        from gateway.bench.overhead import bench_dispatchers_main

        return bench_dispatchers_main(args)
    if args.bench == "simulator":
        from gateway.bench.simulator_scale import bench_simulator_main

        return bench_simulator_main(args)
    if args.bench == "rate":
        from gateway.bench.sustained_rate import bench_rate_main

        return bench_rate_main(args)
    if args.bench == "replicas":
        from gateway.bench.replicas import bench_replicas_main

        return bench_replicas_main(args)
    if args.bench == "prefix-memory":
        from gateway.bench.prefix_memory import bench_prefix_memory_main

        return bench_prefix_memory_main(args)
    from gateway.bench.overhead import bench_overhead_main

    return bench_overhead_main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # These two own their flags entirely; hand them the rest of the command line untouched.
    if argv and argv[0] == "sim-engine":
        from gateway.sim.cli import sim_engine_main

        return sim_engine_main(argv[1:])
    if argv and argv[0] == "real-engine":
        from gateway.realengines.cli import real_engine_main

        return real_engine_main(argv[1:])

    parser = argparse.ArgumentParser(prog="slogate", description="SLO-aware gateway for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", type=Path, help="YAML settings file (environment SLOGATE_* overrides it)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=_serve)

    from gateway.simulator.cli import pd_counts, positive_int

    p = sub.add_parser("up", help="run the gateway with simulated engines on this machine")
    p.add_argument("--config", type=Path, help="extra gateway settings (YAML)")
    # (no defaults here: the file and SLOGATE_* set them when the flags do not; else 127.0.0.1:8000)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--engines", type=positive_int, default=2, help="number of simulated engines")
    p.add_argument(
        "--pd",
        type=pd_counts,
        metavar="P:D",
        help="disaggregated: P prefill and D decode engines (instead of --engines collocated ones)",
    )
    p.add_argument(
        "--kv-transfer",
        choices=("nixl", "bootstrap"),
        default="nixl",
        help="with --pd: how the engines hand over KV (vLLM NIXL style or SGLang bootstrap style)",
    )
    p.add_argument("--profile", default="qwen-7b", help="engine profile for the simulated engines")
    p.add_argument("--model", default=None, help="served model name (default: the profile's)")
    p.add_argument("--time-scale", type=float, default=1.0, help="run simulated time this many times faster")
    p.set_defaults(func=_up)

    sub.add_parser("sim-engine", help="run one simulated vLLM-compatible engine (see --help)")
    sub.add_parser("real-engine", help="provision / run a real local vLLM or llama.cpp engine (see --help)")

    p = sub.add_parser("experiment", help="replay workloads against live gateways with simulated engines")
    exp_sub = p.add_subparsers(dest="experiment", required=True)
    from gateway.experiments.priority_ramp import add_ramp_arguments
    from gateway.experiments.runner import add_experiment_arguments

    add_experiment_arguments(
        exp_sub.add_parser("attainment", help="SLO attainment vs QPS per policy (Experiment A)")
    )
    add_ramp_arguments(
        exp_sub.add_parser("priority-ramp", help="P3..P0 join one by one; P0 TTFT per window (Experiment B)")
    )
    from gateway.simulator.grid import add_grid_arguments

    add_grid_arguments(
        exp_sub.add_parser("grid", help="offline: policies x workloads x load (x capacity) x engine speed")
    )
    from gateway.simulator.pd_experiment import add_pd_arguments

    add_pd_arguments(
        exp_sub.add_parser("pd", help="offline P/D: one-shot RR pairing vs two-stage; FIFO vs RMLQ transfers")
    )
    from gateway.simulator.prefix_experiment import add_prefix_arguments

    add_prefix_arguments(
        exp_sub.add_parser(
            "prefix", help="offline KV-cache-aware routing: hit rate, TTFT, SLO and load per routing profile"
        )
    )
    from gateway.simulator.autoscale_experiment import add_autoscale_arguments

    add_autoscale_arguments(
        exp_sub.add_parser(
            "autoscale",
            help="offline bursts: fixed fleets vs threshold vs Algorithm 3 scaling, warm pool or not",
        )
    )
    from gateway.experiments.migration import add_migration_arguments

    add_migration_arguments(
        exp_sub.add_parser(
            "migration", help="decode migration: an engine killed under load; a slowed engine, slack moves"
        )
    )
    p.set_defaults(func=_experiment)

    p = sub.add_parser("simulate", help="compare policies offline: the gateway's dispatch in virtual time")
    from gateway.simulator.cli import add_simulate_arguments

    add_simulate_arguments(p)
    p.set_defaults(func=_simulate)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    from gateway.bench.overhead import add_overhead_arguments

    add_overhead_arguments(
        bench_sub.add_parser("overhead", help="gateway overhead vs calling the engine directly")
    )
    from gateway.bench.overhead import add_dispatchers_arguments

    add_dispatchers_arguments(
        bench_sub.add_parser(
            "dispatchers",
            help="routing profiles side by side: added latency at c=1, throughput at c=N, "
            "in front of a zero-latency or a real engine",
        )
    )
    from gateway.bench.large_body import add_large_body_arguments

    add_large_body_arguments(
        bench_sub.add_parser("large-body", help="large prompts: gateway CPU, and stalls of other streams")
    )
    from gateway.bench.dispatch import add_dispatch_arguments

    add_dispatch_arguments(
        bench_sub.add_parser("dispatch", help="dispatch loop cost per placement at 16-256 engines, saturated")
    )
    from gateway.bench.simulator_scale import add_simulator_arguments

    add_simulator_arguments(
        bench_sub.add_parser("simulator", help="offline simulator time, 16 to 256 engines (200k requests)")
    )
    from gateway.bench.prefix_memory import add_prefix_memory_arguments

    add_prefix_memory_arguments(
        bench_sub.add_parser(
            "prefix-memory", help="the prefix index's memory against its budget, 1,000,000 blocks"
        )
    )
    from gateway.bench.sustained_rate import add_rate_arguments

    add_rate_arguments(
        bench_sub.add_parser("rate", help="added latency under a sustained open-loop request rate, over time")
    )
    from gateway.bench.replicas import add_replica_arguments

    add_replica_arguments(
        bench_sub.add_parser(
            "replicas",
            help="gateway replicas over the same engines, counting their own or every replica's load",
        )
    )
    p.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
