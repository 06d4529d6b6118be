"""Start and stop real engine servers (vLLM CPU build, llama.cpp ``llama-server``) on local ports.

Every server binds 127.0.0.1 on a port picked at runtime (bind to port 0, read it back), runs in its
own process group (so ``stop()`` also ends vLLM's engine-core child) and writes its output to a log file
in the cache's ``logs/``. Servers still running when the Python process exits are stopped by an
``atexit`` hook, and each server's main process gets SIGTERM if the thread that started it dies
(``PR_SET_PDEATHSIG``), so an interrupted test run leaves no orphans.

vLLM is ready in 45–80 s on 2 cores (more when two start at once); llama-server in ~0.2 s.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gateway.procs import libc_prctl
from gateway.realengines._common import cache_dir, logs_dir, tail_text

EngineKind = Literal["vllm", "llamacpp"]
SchedulingPolicy = Literal["fcfs", "priority"]

VLLM_READY_TIMEOUT = 300.0
LLAMACPP_READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0

_live: dict[int, RunningEngine] = {}


class EngineStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log's tail."""


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: ports handed out by :func:`late_bound_port` in this process (given, perhaps not bound yet)
_LATE_BOUND: set[int] = set()


def late_bound_port() -> int:
    """A free port below the kernel's ephemeral range, for a server that binds it only seconds or
    minutes later (vLLM binds its HTTP port after loading the model, its NIXL side channel ~15 s
    after start). Meanwhile every outgoing connection on the machine takes an ephemeral port: one
    once took the port :func:`free_port` had found free, and that server never came up. Nothing
    takes a port below the range unless asked for it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    if low <= 2048:  # (no room below the range)
        return free_port()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12_000), low)
        if port in _LATE_BOUND:  # (given to a server that has not bound it yet)
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _LATE_BOUND.add(port)
        return port
    return free_port()


@dataclass
class RunningEngine:
    """A real engine server started by this module."""

    kind: EngineKind
    name: str
    model: str
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str]
    started_at: float = field(default_factory=time.monotonic)
    ready_seconds: float | None = None
    kv_events_endpoint: str | None = None
    #: the server's own temporary directory (its TMPDIR), removed when it stops: vLLM leaves its
    #: IPC sockets and torch's rendezvous files (vllm_dist_*) in the temporary directory, and
    #: every start used to add more to /tmp
    scratch: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float | None = None) -> RunningEngine:
        """Poll ``/health`` until it answers 200; raise EngineStartError (and stop) on exit or timeout."""
        limit = (
            timeout
            if timeout is not None
            else (VLLM_READY_TIMEOUT if self.kind == "vllm" else LLAMACPP_READY_TIMEOUT)
        )
        deadline = time.monotonic() + limit
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineStartError(
                    f"{self.kind} server {self.name!r} exited with code {code} before it was ready; "
                    f"log {self.log_path}:\n{tail_text(self.log_path, 40)}"
                )
            if _health_ok(self.url):
                self.ready_seconds = time.monotonic() - self.started_at
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(
                    f"{self.kind} server {self.name!r} not healthy after {limit:.0f} s; "
                    f"log {self.log_path}:\n{tail_text(self.log_path, 40)}"
                )
            time.sleep(0.25 if self.kind == "llamacpp" else 0.5)

    def memory(self) -> dict[str, int]:
        """Current and peak resident memory (bytes) summed over the server's process group."""
        return process_group_memory(self.pid)

    def thread_cpu_seconds(self) -> dict[int, float]:
        """CPU time so far (user + system) of the server's threads other than its processes' main
        threads, by thread id."""
        tick = os.sysconf("SC_CLK_TCK")
        times = {}
        for pid in _group_pids(self.pid):
            with contextlib.suppress(OSError):
                for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                    if tid == pid:
                        continue
                    with contextlib.suppress(OSError, IndexError, ValueError):
                        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                        fields = stat.rsplit(")", 1)[1].split()
                        times[tid] = (int(fields[11]) + int(fields[12])) / tick
        return times

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout`` s; return the exit code."""
        _live.pop(self.pid, None)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.process.wait(timeout=timeout)
        # Children (vLLM's engine core) may outlive the leader for a moment: end the group for good.
        _kill_group_leftovers(self.pid, timeout)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> RunningEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def calm_busy_threads(engines: Iterable[RunningEngine], window: float = 0.5, share: float = 0.1) -> list[int]:
    """Give nice 19 to the engines' side threads that keep using CPU; return their ids.

    For NIXL: its UCX progress thread polls (``ucp_worker_progress``, ``epoll_wait`` with timeout
    0) without ever sleeping, about one core per server even when idle, which on 2 cores slows
    everything else several times over (start-up included). At nice 19 it still polls whenever a
    core is free but yields to everything else. vLLM works in its processes' main threads (the
    engine core's OpenMP pool is one thread, see :func:`vllm_env`), so a side thread above
    ``share`` of a core over ``window`` seconds is such a poller.
    """
    engines = [engine for engine in engines if engine.is_running()]
    before: dict[int, float] = {}
    for engine in engines:
        before.update(engine.thread_cpu_seconds())
    time.sleep(window)
    busy = []
    for engine in engines:
        for tid, spent in engine.thread_cpu_seconds().items():
            if tid in before and spent - before[tid] > share * window:
                busy.append(tid)
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, 19)  # per thread on Linux
    return busy


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def process_group_memory(pgid: int) -> dict[str, int]:
    """Sum of VmRSS and of VmHWM (peak RSS) in bytes over the live processes of a process group."""
    rss = hwm = 0
    for pid in _group_pids(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm += int(line.split()[1]) * 1024
    return {"rss_bytes": rss, "peak_rss_bytes": hwm, "processes": len(_group_pids(pgid))}


def _kill_group_leftovers(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    while _group_pids(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                return
            sig, deadline = signal.SIGKILL, time.monotonic() + 5
        time.sleep(0.2)


def _preexec() -> None:  # runs in the child between fork and exec
    os.setsid()
    prctl = libc_prctl()  # (found in the parent before the fork: see _launch)
    if prctl is not None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the thread that started us


def _launch(
    kind: EngineKind,
    name: str,
    cmd: Sequence[str | os.PathLike[str]],
    port: int,
    env: Mapping[str, str],
    kv_events_endpoint: str | None = None,
) -> RunningEngine:
    args = [os.fspath(c) for c in cmd]
    log_path = logs_dir() / f"{kind}-{name}-{port}.log"
    # (short: a unix socket's path holds at most 107 bytes, and vLLM names its sockets by UUID)
    scratch = Path(tempfile.mkdtemp(prefix=f"slogate-{kind}-"))
    full_env = dict(os.environ)
    full_env.update(env)
    full_env["TMPDIR"] = str(scratch)
    try:
        with log_path.open("wb") as log:
            log.write(f"$ {' '.join(args)}\n".encode())
            log.flush()
            libc_prctl()  # (looked up here: the child only calls it)
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                preexec_fn=_preexec,  # setsid + parent-death signal only
            )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    engine = RunningEngine(
        kind=kind,
        name=name,
        model=name,
        host="127.0.0.1",
        port=port,
        process=proc,
        log_path=log_path,
        command=args,
        kv_events_endpoint=kv_events_endpoint,
        scratch=scratch,
    )
    _live[proc.pid] = engine
    return engine


def vllm_server_command(
    python: Path | str,
    model_dir: Path | str,
    name: str,
    port: int,
    *,
    scheduling_policy: SchedulingPolicy = "fcfs",
    kv_events_config: Mapping[str, object] | None = None,
    extra_args: Sequence[str] = (),
    aliases: Sequence[str] = (),
) -> list[str]:
    """The vLLM OpenAI server command line known to work on this CPU-only machine.

    ``aliases`` are further served model names (vLLM answers to any of them and reports the first),
    so two differently configured servers can stand behind one model name at the gateway."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        *aliases,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        # The model runs inside the engine-core process (with VLLM_ENABLE_V1_MULTIPROCESSING=0, see
        # vllm_env). vLLM's CPU default adds a worker process that the engine core spin-waits on.
        "--distributed-executor-backend",
        "uni",
    ]
    if scheduling_policy != "fcfs":
        cmd += ["--scheduling-policy", scheduling_policy]
    if kv_events_config is not None:
        cmd += ["--kv-events-config", json.dumps(dict(kv_events_config))]
    cmd += list(extra_args)
    return cmd


def vllm_env(name: str) -> dict[str, str]:
    """Environment for a vLLM CPU server: offline, 1 GiB KV cache, a private cache root per name.

    CPU on a 2-core box: by default the model runs in a worker process that the engine core
    spin-waits on, and the OpenMP thread is pinned to core 0. Measured under 5 concurrent streams:
    the two busy processes starved the API server *and* unrelated processes (the client's own
    threads slept 4-10 s past their timers), streams arrived seconds after the engine had finished
    them and ``/metrics`` took up to 7 s. With the worker in the engine-core process (no spinning
    peer), one unbound OpenMP thread (plenty for the tiny model), ``/metrics`` answers in ~50 ms,
    tokens stream at the pace they are made, and nothing else on the machine stalls.
    """
    root = cache_dir() / "vllm-cache" / name
    root.mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(root),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


def start_vllm(
    name: str,
    *,
    scheduling_policy: SchedulingPolicy = "fcfs",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_topic: str = "kv",
    wait: bool = True,
    ready_timeout: float | None = None,
    model_dir: Path | None = None,
    aliases: Sequence[str] = (),
) -> RunningEngine:
    """Start a vLLM CPU server serving the tiny HF model as ``name`` (provisions the venv/model if needed).

    ``kv_events_endpoint`` turns on ZMQ KV-cache events (``tcp://*:P`` makes vLLM bind; a plain
    ``tcp://127.0.0.1:P`` makes it connect to a subscriber that binds). With ``wait=False`` the caller
    must call :meth:`RunningEngine.wait_ready` (useful to start several servers at once).
    """
    from gateway.realengines.tiny_models import ensure_hf_model
    from gateway.realengines.vllm_env import ensure_vllm_env

    python = ensure_vllm_env()
    model = model_dir if model_dir is not None else ensure_hf_model(python=python)
    port = port if port is not None else late_bound_port()
    kv_config = None
    if kv_events_endpoint is not None:
        kv_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_events_endpoint,
            "topic": kv_events_topic,
        }
    cmd = vllm_server_command(
        python,
        model,
        name,
        port,
        scheduling_policy=scheduling_policy,
        kv_events_config=kv_config,
        extra_args=extra_args,
        aliases=aliases,
    )
    full_env = vllm_env(name)
    full_env.update(env or {})
    engine = _launch("vllm", name, cmd, port, full_env, kv_events_endpoint=kv_events_endpoint)
    return engine.wait_ready(ready_timeout) if wait else engine


@functools.cache
def _llama_server_help(binary: str) -> str:
    proc = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False, timeout=60)
    return proc.stdout + proc.stderr


def llamacpp_server_command(
    binary: Path | str,
    model_path: Path | str,
    name: str,
    port: int,
    *,
    ctx_size: int = 4096,
    parallel: int = 2,
    threads: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The llama-server command line; drops flags this build does not know (checked via ``--help``).

    ``threads`` defaults to all cores but one. With every core busy computing, llama-server's HTTP
    threads starve: measured on 2 cores with ``-t 2``, a 4000-token stream paused for up to 2 s and then
    arrived in a burst, and ``/metrics`` took up to 2.3 s to answer; with ``-t 1`` the longest gap
    between chunks was 0.1 s, for ~25 % fewer tokens per second.
    """
    if threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
    help_text = _llama_server_help(str(binary))
    cmd = [
        str(binary),
        "-m",
        str(model_path),
        "-a",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(ctx_size),
        "-np",
        str(parallel),
        "-t",
        str(threads),
        "--metrics",
    ]
    if "--slots" in help_text:
        cmd.append("--slots")
    if "--no-ui" in help_text:
        cmd.append("--no-ui")
    elif "--no-webui" in help_text:
        cmd.append("--no-webui")
    cmd += list(extra_args)
    return cmd


def start_llamacpp(
    name: str,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    ctx_size: int = 4096,
    parallel: int = 2,
    threads: int | None = None,
    wait: bool = True,
    ready_timeout: float | None = None,
    model_path: Path | None = None,
) -> RunningEngine:
    """Start ``llama-server`` serving the tiny GGUF as ``name`` (builds the binary/model if needed)."""
    from gateway.realengines.llamacpp_build import ensure_llama_server
    from gateway.realengines.tiny_models import ensure_gguf_model

    binary = ensure_llama_server()
    model = model_path if model_path is not None else ensure_gguf_model()
    port = port if port is not None else late_bound_port()
    cmd = llamacpp_server_command(
        binary,
        model,
        name,
        port,
        ctx_size=ctx_size,
        parallel=parallel,
        threads=threads,
        extra_args=extra_args,
    )
    engine = _launch("llamacpp", name, cmd, port, dict(env or {}))
    return engine.wait_ready(ready_timeout) if wait else engine


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet."""
    for engine in list(_live.values()):
        engine.stop()


atexit.register(stop_all)
