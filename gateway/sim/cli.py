"""``slogate sim-engine``: one simulated vLLM-compatible engine.

Prints ``slogate-sim listening on http://HOST:PORT`` once bound (the real port when ``--port 0``)
and stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys

import zmq
from pydantic import ValidationError

from gateway.open_files import raise_open_files_limit
from gateway.sim.lora import parse_lora_modules
from gateway.sim.profiles import EngineProfile, ProfileError, load_profile
from gateway.sim.responses_store import DEFAULT_CAPACITY as DEFAULT_STORE_CAPACITY
from gateway.sim.server import SimConfig, SimServer


def _port(text: str) -> int:
    """A TCP port, 0-65535 (past it the socket took the number modulo 65536, unsaid)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _store_size(text: str) -> int:
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of responses: {text!r}") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"a store holds 0 or more responses, got {size}")
    return size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slogate sim-engine", description="simulated vLLM-compatible engine")
    p.add_argument("--profile", default="qwen-7b", help="name in profiles/engines or a YAML path")
    p.add_argument("--model", help="served model name (default: the profile's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=0, help="0 picks a free port")
    p.add_argument("--role", choices=["collocated", "prefill", "decode"], default="collocated")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated time runs this many times faster")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="true speed relative to the profile (2: every step takes half the profile's time)",
    )
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-gpu-blocks", type=int)
    p.add_argument("--embedding-dim", type=int, help="length of /v1/embeddings vectors (profile: 384)")
    p.add_argument(
        "--no-embeddings",
        action="store_true",
        help="a generation-only model: /v1/embeddings answers 400 'does not support Embeddings API'",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters loaded at start-up, as vLLM's: /v1/models lists each with the served "
        "model as its parent, and requests naming one are served (like the base model)",
    )
    p.add_argument("--kv-events-endpoint", help="ZMQ endpoint for KV events, e.g. tcp://*:5557")
    p.add_argument("--kv-events-topic", default="kv")
    p.add_argument("--engine-id", default="0", help="the 'engine' metric label and KV-transfer engine id")
    p.add_argument(
        "--responses-store-size",
        type=_store_size,
        default=DEFAULT_STORE_CAPACITY,
        metavar="N",
        help="Responses API store: keep the last N responses (retrieve, previous_response_id, "
        "background); 0 turns it off, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE=1",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="selects the deterministic output function; engines that continue each other's "
        "requests must share it",
    )
    return p


async def _serve(config: SimConfig) -> int:
    try:
        server = SimServer(config)  # (its KV-event socket binds or connects here)
    except zmq.ZMQError as exc:
        print(
            f"slogate sim-engine: --kv-events-endpoint {config.kv_events_endpoint}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2 if exc.errno == zmq.EINVAL else 1
    try:
        url = await server.start()
    except OSError as exc:  # (a busy port: one line, and what start opened is closed)
        await server.stop()
        print(
            f"slogate sim-engine: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    print(f"slogate-sim listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    return 0


def sim_engine_main(argv: list[str]) -> int:
    """Entry point of ``slogate sim-engine``; returns the process exit code (2 on bad arguments)."""
    args = build_parser().parse_args(argv)
    if not args.time_scale > 0 or not math.isfinite(args.time_scale):
        print("slogate sim-engine: --time-scale must be a finite number > 0", file=sys.stderr)
        return 2
    if not args.speed > 0 or not math.isfinite(args.speed):
        print("slogate sim-engine: --speed must be a finite number > 0", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"slogate sim-engine: {exc}", file=sys.stderr)
        return 2
    overrides = {
        k: v
        for k, v in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("num_gpu_blocks", args.num_gpu_blocks),
            ("embedding_dim", args.embedding_dim),
        )
        if v is not None
    }
    if overrides:
        try:
            # validated like the file itself, so a bad override is an error and not a broken engine
            profile = EngineProfile.model_validate({**profile.model_dump(), **overrides})
        except ValidationError as exc:
            err = exc.errors()[0]
            print(f"slogate sim-engine: {err['loc'][0]}: {err['msg']}", file=sys.stderr)
            return 2
    try:
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        print(f"slogate sim-engine: {exc}", file=sys.stderr)
        return 2
    config = SimConfig(
        profile=profile,
        model=args.model or profile.model,
        engine_id=args.engine_id,
        role=args.role,
        time_scale=args.time_scale,
        speed=args.speed,
        scheduling_policy=args.scheduling_policy,
        host=args.host,
        port=args.port,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        seed=args.seed,
        embeddings=not args.no_embeddings,
        lora_modules=tuple(lora_modules.items()),
        responses_store=args.responses_store_size,
    )
    raise_open_files_limit()
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:
            return asyncio.run(_serve(config))
        else:
            return uvloop.run(_serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(sim_engine_main(sys.argv[1:]))
