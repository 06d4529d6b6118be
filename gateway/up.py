"""``slogate up``: simulated engines plus the gateway on this machine, in-memory state.

Engines run as child processes (so they use the second core); the gateway runs in this
process. Ctrl-C or SIGTERM stops the gateway first (draining in-flight requests), then every
engine; nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import yaml

from gateway.dispatch.build import RoutingProfile
from gateway.dispatch.slo_service import SloService
from gateway.procs import ChildProcess, spawn_sim_engine
from gateway.server import build_app, listening_socket, serve
from gateway.settings import load_settings_or_exit
from gateway.sim.profiles import ProfileError
from policies.api import PolicyConfigError


def run_up(args: argparse.Namespace) -> int:
    engines: list[ChildProcess] = []
    roles: list[str] = []
    stopping = threading.Event()
    replaced_keys = _replaced_engines(args.config)
    listen = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    # the configuration and its profiles checked before any engine starts (a missing file, a
    # misspelt setting or plugin: one line, not engines started and stopped for nothing)
    _preflight(args, replaced_keys, listen)
    try:
        if args.pd is not None:
            prefill, decode = args.pd
            plan = [("prefill", f"prefill-{i}") for i in range(prefill)]
            plan += [("decode", f"decode-{i}") for i in range(decode)]
        else:
            plan = [("collocated", f"sim-{i}") for i in range(args.engines)]
        for role, name in plan:
            extra = ["--profile", args.profile, "--time-scale", str(args.time_scale), "--engine-id", name]
            if role != "collocated":
                extra += ["--role", role]
            if args.model:
                extra += ["--model", args.model]
            engines.append(spawn_sim_engine(*extra, name=name))
            roles.append(role)
            _watch(engines[-1], stopping)
        model = args.model or _served_model(engines[0].url)
        settings = load_settings_or_exit(
            args.config,
            also_named=replaced_keys,
            **listen,
            engines=[
                {
                    "url": e.url,
                    "kind": "sim",
                    "model": model,
                    "name": e.name,
                    "role": role,
                    **({"kv_transfer": args.kv_transfer} if role == "prefill" else {}),
                }
                for e, role in zip(engines, roles, strict=True)
            ],
            # every engine here is simulated: let clients drive them (X-Sim-Output-Len, X-Sim-Fault)
            forward_sim_headers=True,
        )
        try:
            # bound before anything says where: a busy port is one line, not a banner and then a
            # traceback, and port 0 shows the one it got
            listener = listening_socket(settings.host, settings.port)
        except OSError as exc:
            print(
                f"slogate up: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return 1
        app = build_app(settings)  # (a profile refused before the banner says it serves)
        host, port = listener.getsockname()[:2]
        base = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        print(f"slogate gateway on {base}  ({len(engines)} simulated engines, model {model!r})", flush=True)
        for e, role in zip(engines, roles, strict=True):
            print(f"  engine {e.name} ({role}): {e.url}", flush=True)
        print(
            f"try:\n  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
            f'"max_tokens": 32}}\'\nCtrl-C stops everything.',
            flush=True,
        )
    except (RuntimeError, OSError) as exc:  # (an engine that did not start, or did not answer)
        _stop(engines, stopping)
        print(f"slogate up: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        _stop(engines, stopping)
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C while the engines start: no traceback
            print("slogate up: interrupted", file=sys.stderr)
            return 130
        raise
    # (out of the start-up's handler: an error of the running gateway is a traceback, a bug to
    # read, not one line that looks like an engine that did not start)
    try:
        serve(settings, listener, app)
        return 0
    finally:
        _stop(engines, stopping)


def _stop(engines: list[ChildProcess], stopping: threading.Event) -> None:
    """Stop every engine, a second Ctrl-C meanwhile included (it skipped the rest, with a
    traceback): they are told to stop first, then waited for."""
    stopping.set()
    with _sigint_ignored():
        for e in engines:
            e.signal_stop()
        for e in engines:
            e.stop()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _preflight(args: argparse.Namespace, replaced_keys: set[str], listen: dict[str, object]) -> None:
    """Exit (2) with the configuration's error, before any engine starts (its warnings are
    the real load's to give, once)."""
    quiet = logging.getLogger("slogate.settings")
    was, quiet.disabled = quiet.disabled, True
    try:
        settings = load_settings_or_exit(
            args.config,
            also_named=replaced_keys,
            **listen,
            engines=[
                {
                    "url": "http://127.0.0.1:1",
                    "kind": "sim",
                    "model": args.model or "preflight",
                    "name": "preflight",
                }
            ],
            forward_sim_headers=True,
        )
    finally:
        quiet.disabled = was
    try:
        RoutingProfile.load(settings.routing_profile_path())
        SloService(settings)
    except (PolicyConfigError, ProfileError) as exc:
        print(f"slogate: invalid profile: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _watch(engine: ChildProcess, stopping: threading.Event) -> None:
    """Say when an engine exits on its own (and reap it): the gateway ejects it and serves on
    with the others, which is easy to miss in its log."""

    def wait() -> None:
        code = engine.proc.wait()
        if not stopping.is_set():
            print(
                f"slogate up: engine {engine.name} exited (code {code}); the gateway serves without it",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=wait, name=f"watch-{engine.name}", daemon=True).start()


def _replaced_engines(config: Path | None) -> set[str]:
    """``up`` serves its own simulated engines: say so when the file or the environment names
    others (they were dropped without a word). Returns the variables those engines'
    ``api_key_env`` name: set for them, they are no misspelt settings."""
    listed: list[object] = []
    # (settings read the environment's names in any case)
    values = [v for k, v in os.environ.items() if k.upper() == "SLOGATE_ENGINES"]
    named = bool(values)
    for value in values:
        with contextlib.suppress(ValueError, RecursionError):
            engines = json.loads(value)
            listed += engines if isinstance(engines, list) else []
    if config is not None:
        # (a file that is not UTF-8 is refused, cleanly, when the settings load)
        with contextlib.suppress(OSError, ValueError, yaml.YAMLError):
            data = yaml.safe_load(config.read_text())
            if isinstance(data, dict) and "engines" in data:
                named = True
                listed += data["engines"] if isinstance(data["engines"], list) else []
    if named:
        print(
            "slogate up: the engines in the configuration are not used (up runs its own simulated "
            "engines; `slogate serve` runs a gateway in front of yours)",
            file=sys.stderr,
        )
    return {e["api_key_env"] for e in listed if isinstance(e, dict) and isinstance(e.get("api_key_env"), str)}


def _served_model(url: str) -> str:
    import urllib.request

    import orjson

    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
        return str(orjson.loads(resp.read())["data"][0]["id"])
