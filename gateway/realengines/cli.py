"""Command line for real engines: ``prepare`` (provision caches) and ``run`` (one engine in the foreground).

Usage (the lead wires this as ``slogate real-engine ...``)::

    python -m gateway.realengines.cli prepare [--vllm] [--llamacpp] [--nixl] [--force]
    python -m gateway.realengines.cli run vllm|llamacpp [--name N] [--port P] [--priority]
    python -m gateway.realengines.cli status
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from gateway.realengines._common import ProvisionError, cache_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slogate real-engine",
        description="Provision and run real local inference engines (vLLM CPU build, llama.cpp) "
        f"with tiny locally made models. Caches live in {cache_dir()} (env SLOGATE_CACHE_DIR).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare", help="create the cached venv, binary and models (default: everything)")
    prep.add_argument("--vllm", action="store_true", help="the vLLM CPU venv and the tiny HF model")
    prep.add_argument("--llamacpp", action="store_true", help="the llama-server binary and the tiny GGUF")
    prep.add_argument("--nixl", action="store_true", help="also install nixl into the vLLM venv")
    prep.add_argument("--force", action="store_true", help="rebuild even if cached")

    run = sub.add_parser("run", help="start one engine in the foreground (Ctrl-C stops it)")
    run.add_argument("engine", choices=["vllm", "llamacpp"])
    run.add_argument("--name", default=None, help="served model name (default tiny-vllm / tiny-llamacpp)")
    run.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)")
    run.add_argument("--priority", action="store_true", help="vLLM: --scheduling-policy priority")

    sub.add_parser("status", help="show what is cached")
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from gateway.realengines.llamacpp_build import ensure_llama_server
    from gateway.realengines.tiny_models import ensure_gguf_model, ensure_hf_model
    from gateway.realengines.vllm_env import ensure_vllm_env

    both = not args.vllm and not args.llamacpp
    timings: list[tuple[str, float]] = []

    def step(label: str, func: object) -> None:
        started = time.monotonic()
        result = func() if callable(func) else None
        timings.append((label, time.monotonic() - started))
        print(f"{label}: {result}")

    if args.vllm or both:
        step("vllm venv python", lambda: ensure_vllm_env(nixl=args.nixl, force=args.force))
        step("tiny HF model", lambda: ensure_hf_model(force=args.force))
    if args.llamacpp or both:
        step("llama-server", lambda: ensure_llama_server(force=args.force))
        step("tiny GGUF model", lambda: ensure_gguf_model(force=args.force))
    for label, seconds in timings:
        print(f"  {label}: {seconds:.1f} s", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    from gateway.realengines.servers import start_llamacpp, start_vllm

    name = args.name or f"tiny-{args.engine}"
    if args.engine == "vllm":
        print(f"starting vLLM (CPU) as {name!r}; this takes about a minute...", file=sys.stderr, flush=True)
        engine = start_vllm(name, scheduling_policy="priority" if args.priority else "fcfs", port=args.port)
    else:
        engine = start_llamacpp(name, port=args.port)

    stop_requested = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    print(f"{args.engine} ready in {engine.ready_seconds or 0:.1f} s", file=sys.stderr)
    print(f"URL:   {engine.url}  (OpenAI API under {engine.url}/v1)")
    print(f"model: {engine.model}")
    if args.engine == "vllm":
        from gateway.realengines.tiny_models import hf_model_dir

        # the gateway keys this model's prompts as vLLM tokenizes them with this setting
        tokenizer = hf_model_dir()
        print(f"tokenizer: {tokenizer}  (gateway: engine_tokenizers: {{{engine.model}: {tokenizer}}})")
    print(f"pid:   {engine.pid}   log: {engine.log_path}")
    print("Ctrl-C to stop.", flush=True)
    try:
        while not stop_requested and engine.is_running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        code = engine.stop()
    if not stop_requested and code not in (None, 0, -signal.SIGTERM, -signal.SIGINT):
        print(f"engine exited with code {code}; see {engine.log_path}", file=sys.stderr)
        return 1
    return 0


def cache_status() -> list[tuple[str, bool, Path]]:
    """(what, cached?, where) for every provisioned part."""
    from gateway.realengines.llamacpp_build import is_llama_server_ready, llama_server_path
    from gateway.realengines.tiny_models import _gguf_marker, _hf_marker, gguf_model_path, hf_model_dir
    from gateway.realengines.vllm_env import is_vllm_env_ready, vllm_venv_dir

    return [
        ("vllm venv", is_vllm_env_ready(), vllm_venv_dir()),
        ("llama-server", is_llama_server_ready(), llama_server_path()),
        ("tiny HF model", _hf_marker().exists(), hf_model_dir()),
        ("tiny GGUF model", _gguf_marker().exists(), gguf_model_path()),
        ("nixl in vllm venv", is_vllm_env_ready(nixl=True), vllm_venv_dir()),
    ]


def _status() -> int:
    for label, ready, path in cache_status():
        print(f"{label:16} {'ready' if ready else 'missing':8} {path}")
    return 0


def real_engine_main(argv: list[str]) -> int:
    """Entry point of ``slogate real-engine``; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "run":
            return _run(args)
        return _status()
    except ProvisionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # EngineStartError and friends
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(real_engine_main(sys.argv[1:]))
