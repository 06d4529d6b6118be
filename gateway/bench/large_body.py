"""``slogate bench large-body``: large prompts cost little CPU and never stall other streams.

One single-worker gateway runs in front of two child engines: a simulated engine that paces
tokens ``--token-gap-ms`` apart, and a sink that answers any request at once without reading its
prompt (so that no engine tokenizes 200 KB or 15 MB on the same cores as the gateway).

(a) Gateway CPU per request for a 200 KB prompt (UTF-8; English, and a non-ASCII mix), against the
    sink at concurrency 1, next to a small request's: the difference is what the prompt's size
    costs (reading, parsing, estimating its tokens, forwarding it). Latency is compared with
    calling the engine directly. (Against the simulated engine, which counts a prompt's tokens
    exactly, 70 ms a request, the gateway's share was buried under the engine's: its CPU is read
    less an idle rate over the whole time, and the engine's work shared the two cores.)
(b) ``--streams`` concurrent streams through the gateway; in every other round one 15 MB body is
    sent while they run. The largest gap between two chunks of any stream, with and without the
    big body, says how long the gateway's event loop was held: the streams share that loop. Done
    for an English (ASCII) body and a non-ASCII one: orjson parses ASCII JSON strings several
    times faster, and that parse is one block the loop cannot interleave.

``--key-only`` measures in this process, without engines or a gateway, what (a)'s prefix-index
key costs for each prompt (its tokens, then its block hashes: the issue's <= 2 ms), best of
``--key-repeat`` tries (``slogate bench large-body --key-only --prompt-texts
english,mixed,non-ascii``; ``--prompt-chars 200000`` for prompts of that many characters).

CPU is the gateway process's (``/proc/<pid>/task/*/schedstat``), less its idle rate (monitor
scrapes) over the measurement. The gaps are wall time seen by this process, so a busy machine
widens both columns; the rounds alternate to expose the same noise to both.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway.api.request_parse import parse_request
from gateway.bench.harness import (
    checks_table,
    cpu_seconds,
    engine_entry,
    idle_cpu_rate,
    kernel_seconds,
    paced_profile,
    percentile,
    progress,
    spawn_gateway,
    spawn_paced_engine,
    spawn_sink,
    traced_stream,
    wait_until_served,
)
from gateway.bench.texts import GENERATORS
from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.prompt_key import MessageTokens, chat_token_ids, prompt_blocks
from gateway.procs import ChildProcess

MODEL = "bench-model"  # (the prefix-index key figures: in-process, no engine)
PACED_MODEL = "bench-paced"
SINK_MODEL = "bench-sink"
DEFAULT_RESULTS_DIR = Path("results/bench-large-body")
_JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass
class PromptCase:
    """Requests carrying one large prompt, through the gateway and directly."""

    text: str
    body_bytes: int
    #: gateway CPU per request, and its excess over a small request's
    gateway_cpu_ms: float
    over_small_ms: float
    direct_p50_ms: float
    gateway_p50_ms: float
    #: parse_request on the same body in this process (orjson parse and token estimate): the part
    #: of the gateway's CPU that is parsing and estimating rather than moving bytes
    parse_ms: float
    #: keying the prompt for the prefix index in this process (tokens as the engine's template
    #: renders them, block hashes), a fresh prompt and a conversation's next turn (its history,
    #: this prompt, cached; a 1 KB new message)
    prefix_key_ms: float = 0.0
    prefix_turn_ms: float = 0.0
    #: the part of ``over_small_ms`` spent in the kernel (the body's bytes copied in from the
    #: client's socket and out to the engine's)
    over_small_kernel_ms: float = 0.0

    @property
    def added_p50_ms(self) -> float:
        return self.gateway_p50_ms - self.direct_p50_ms


@dataclass
class GapRound:
    big_body: bool
    #: largest gap between two chunks of any stream, over the whole round
    max_gap_ms: float
    #: the same over the gaps that overlap the big body's time in flight (None without one)
    max_gap_in_flight_ms: float | None
    gateway_cpu_ms: float
    events: int
    big_body_status: int | None = None
    big_body_s: float | None = None


@dataclass
class BigBodyCase:
    """One big body sent while streams run (and alone, for its CPU)."""

    text: str
    body_bytes: int
    #: gateway CPU to take in, parse, forward and answer it with nothing else running
    gateway_cpu_ms: float
    #: in this process, for reference: parse_request on it (orjson.loads + estimate), and
    #: orjson.dumps of the parsed body (the gateway re-serialises a streamed request's body to
    #: ask the engine for usage)
    parse_ms: float
    json_dumps_ms: float
    rounds: list[GapRound] = field(default_factory=list)

    @property
    def max_gap_without_ms(self) -> float:
        return statistics.median(r.max_gap_ms for r in self.rounds if not r.big_body)

    @property
    def max_gap_with_ms(self) -> float:
        return statistics.median(r.max_gap_ms for r in self.rounds if r.big_body)

    @property
    def added_gap_ms(self) -> float:
        return self.max_gap_with_ms - self.max_gap_without_ms


@dataclass
class LargeBodyResult:
    requests: int
    small_cpu_ms: float
    small_direct_p50_ms: float
    small_gateway_p50_ms: float
    prompts: list[PromptCase]
    streams: int
    token_gap_ms: float
    stream_tokens: int
    big_bodies: list[BigBodyCase]
    #: the small request's gateway CPU in the kernel (socket reads and writes)
    small_kernel_ms: float = 0.0

    def checks(self) -> list[tuple[str, str, str, bool]]:
        """(figure, measured, target, met) rows."""
        rows: list[tuple[str, str, str, bool]] = [
            ("gateway CPU, small request (reference)", f"{self.small_cpu_ms:.3f} ms", "(reported)", True)
        ]
        for case in self.prompts:
            size = f"{case.body_bytes / 1000:.0f} KB {case.text} prompt"
            rows += [
                # the target is on parsing and estimating (what the prompt's length used to cost:
                # 6.3 ms for 200 KB); moving the bytes in and out is reported beside it
                (
                    f"{size}: parse + estimate (parse_request, in-process)",
                    f"{case.parse_ms:.3f} ms",
                    "<= 1 ms",
                    case.parse_ms <= 1.0,
                ),
                (
                    f"{size}: prefix-index key, fresh prompt (tokens + block hashes)",
                    f"{case.prefix_key_ms:.3f} ms",
                    "<= 2 ms",
                    case.prefix_key_ms <= 2.0,
                ),
                (
                    "  prefix-index key, next turn (history cached, 1 KB new message)",
                    f"{case.prefix_turn_ms:.3f} ms",
                    "<= 2 ms",
                    case.prefix_turn_ms <= 2.0,
                ),
                # and, read strictly, the target is on all the prompt adds to its request, the
                # bytes' way in and out included: judged for English, the issue's case (a
                # non-ASCII body's parse alone is ~0.6 ms in orjson, reported)
                (
                    "  gateway CPU over a small request (parse, estimate, I/O)",
                    f"{case.over_small_ms:.3f} ms, {case.over_small_kernel_ms:.3f} of it in the kernel "
                    f"(whole request {case.gateway_cpu_ms:.3f})",
                    "<= 1 ms" if case.text == "english" else "(reported)",
                    case.over_small_ms <= 1.0 or case.text != "english",
                ),
                (
                    "  latency p50: direct / gateway",
                    f"{case.direct_p50_ms:.2f} / {case.gateway_p50_ms:.2f} ms (+{case.added_p50_ms:.2f})",
                    "(reported)",
                    True,
                ),
            ]
        for big in self.big_bodies:
            body = f"{big.body_bytes / 1e6:.0f} MB {big.text} body"
            rows += [
                (
                    f"largest gap, {self.streams} streams: without / with a {body}",
                    f"{big.max_gap_without_ms:.1f} / {big.max_gap_with_ms:.1f} ms (median of rounds)",
                    "(reported)",
                    True,
                ),
                (
                    f"{body}: added largest gap",
                    f"{big.added_gap_ms:+.1f} ms",
                    "<= 20 ms",
                    big.added_gap_ms <= 20.0,
                ),
                (
                    f"  gateway CPU per {body}",
                    f"{big.gateway_cpu_ms:.1f} ms (here: parse_request {big.parse_ms:.1f}, "
                    f"orjson.dumps {big.json_dumps_ms:.1f})",
                    "(reported)",
                    True,
                ),
            ]
        return rows


def _chat_body(model: str, content: str, **extra: object) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], **extra})


def _text_of_bytes(kind: str, n_bytes: int) -> str:
    """Text of kind ``kind`` whose UTF-8 form is ``n_bytes`` long, or a character short of it."""
    text = GENERATORS[kind](n_bytes, 12)  # at least n_bytes of UTF-8: a character is >= 1 byte
    cut = len(text.encode()[:n_bytes].decode(errors="ignore"))
    return text[:cut]


def _prompt_text(kind: str, config: LargeBodyConfig) -> str:
    if config.prompt_chars is not None:
        return GENERATORS[kind](config.prompt_chars, 12)
    return _text_of_bytes(kind, config.prompt_bytes)


def _cpu_ms(pid: int, c0: float, t0: float, idle: float, n: int) -> float:
    """Gateway CPU per request since (c0, t0), less the idle rate over the time taken."""
    return (cpu_seconds(pid) - c0 - idle * (time.perf_counter() - t0)) / n * 1e3


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=_JSON_HEADERS) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
    return time.perf_counter() - t0


async def _interleaved(
    session: aiohttp.ClientSession,
    engine: ChildProcess,
    gateway: ChildProcess,
    body: bytes,
    n: int,
    idle: float,
) -> tuple[float, float, float, float]:
    """``n`` requests directly and ``n`` through the gateway, alternating, at concurrency 1:
    (gateway CPU ms per request, direct p50 ms, gateway p50 ms, the gateway's kernel CPU ms per
    request). The direct requests do not touch the gateway, so its CPU over the loop is its CPU
    for the ``n`` it served."""
    direct: list[float] = []
    via: list[float] = []
    c0, k0, t0 = cpu_seconds(gateway.pid), kernel_seconds(gateway.pid), time.perf_counter()
    for _ in range(n):
        direct.append(await _post(session, engine.url + "/v1/chat/completions", body))
        via.append(await _post(session, gateway.url + "/v1/chat/completions", body))
    cpu = _cpu_ms(gateway.pid, c0, t0, idle, n)
    # (the idle process's kernel time is a few scrapes a second: not worth a second idle read)
    kernel = (kernel_seconds(gateway.pid) - k0) / n * 1e3
    return cpu, percentile(direct, 0.5) * 1e3, percentile(via, 0.5) * 1e3, kernel


def _send_big_body(url: str, body: bytes) -> tuple[int, float, float]:
    """POST ``body`` from a thread (plain http.client, so this process's event loop, which times
    the streams, is not the one copying 15 MB); (status, start, end) in perf_counter time."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    start = time.perf_counter()
    try:
        connection.request("POST", "/v1/chat/completions", body=body, headers=_JSON_HEADERS)
        response = connection.getresponse()
        response.read()
        return response.status, start, time.perf_counter()
    finally:
        connection.close()


async def _gap_round(
    session: aiohttp.ClientSession,
    gateway: ChildProcess,
    streams: int,
    stream_body: bytes,
    stream_headers: dict[str, str],
    big_body: bytes | None,
    idle: float,
) -> GapRound:
    url = gateway.url + "/v1/chat/completions"
    c0, t0 = cpu_seconds(gateway.pid), time.perf_counter()
    tasks = [
        asyncio.create_task(traced_stream(session, url, stream_body, stream_headers)) for _ in range(streams)
    ]
    # let every stream reach its steady pace before the big body lands (the traces fill as they go)
    await asyncio.sleep(0.5)
    sent: tuple[int, float, float] | None = None
    if big_body is not None:
        sent = await asyncio.to_thread(_send_big_body, gateway.url, big_body)
    traces = await asyncio.gather(*tasks)
    cpu = _cpu_ms(gateway.pid, c0, t0, idle, 1)
    gaps = [gap for trace in traces for gap in trace.gaps()]
    in_flight = None
    if sent is not None:
        _, start, end = sent
        overlapping = [length for at, length in gaps if at < end and at + length > start]
        in_flight = max(overlapping, default=0.0) * 1e3
    return GapRound(
        big_body=big_body is not None,
        max_gap_ms=max(length for _, length in gaps) * 1e3,
        max_gap_in_flight_ms=in_flight,
        gateway_cpu_ms=cpu,
        events=sum(t.events for t in traces),
        big_body_status=sent[0] if sent else None,
        big_body_s=(sent[2] - sent[1]) if sent else None,
    )


@dataclass
class LargeBodyConfig:
    requests: int = 200
    prompt_bytes: int = 200_000
    #: prompts of this many characters instead of ``prompt_bytes`` bytes of UTF-8
    prompt_chars: int | None = None
    prompt_texts: tuple[str, ...] = ("english", "mixed")
    streams: int = 100
    token_gap_ms: float = 20.0
    stream_tokens: int = 100
    big_bytes: int = 15_000_000
    big_texts: tuple[str, ...] = ("english", "mixed")
    rounds: int = 3


async def _measure(
    config: LargeBodyConfig, sink: ChildProcess, gateway: ChildProcess, big_bodies: dict[str, bytes]
) -> LargeBodyResult:
    n = config.requests
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for model in (PACED_MODEL, SINK_MODEL):
            await wait_until_served(session, gateway.url, model)
        small = _chat_body(SINK_MODEL, "Say hello to the benchmark.", max_tokens=1)
        prompts = {
            kind: _chat_body(SINK_MODEL, _prompt_text(kind, config), max_tokens=1)
            for kind in config.prompt_texts
        }
        progress("warm-up")
        for body in (small, *prompts.values()):
            for _ in range(10):
                await _post(session, gateway.url + "/v1/chat/completions", body)
        # the first large body started the gateway's parse worker, and large bodies are parsed in
        # place until it is up (about a second): what is measured is the worker's steady state
        await asyncio.sleep(3.0)
        idle = await idle_cpu_rate(gateway.pid, 1.0)

        progress(f"(a) {n} small requests, direct and through the gateway (interleaved)")
        small_cpu, small_direct, small_via, small_kernel = await _interleaved(
            session, sink, gateway, small, n, idle
        )
        cases: list[PromptCase] = []
        for kind, body in prompts.items():
            progress(f"(a) {n} requests with a {config.prompt_bytes / 1000:.0f} KB {kind} prompt")
            cpu, direct_p50, via_p50, kernel = await _interleaved(session, sink, gateway, body, n, idle)
            parse = _best_ms(lambda: parse_request("chat", body, 1))  # noqa: B023 (called at once)
            fresh, turn = _prefix_key_ms(body)
            cases.append(
                PromptCase(
                    kind,
                    len(body),
                    cpu,
                    cpu - small_cpu,
                    direct_p50,
                    via_p50,
                    parse,
                    fresh,
                    turn,
                    over_small_kernel_ms=kernel - small_kernel,
                )
            )

        stream_body = _chat_body(
            PACED_MODEL,
            "Say hello to the benchmark.",
            max_tokens=config.stream_tokens,
            ignore_eos=True,
            stream=True,
        )
        stream_headers = {**_JSON_HEADERS, "X-Sim-Output-Len": str(config.stream_tokens)}
        bigs: list[BigBodyCase] = []
        for kind, big_body in big_bodies.items():
            bigs.append(
                await _big_body_case(
                    session, gateway, config, kind, big_body, stream_body, stream_headers, idle
                )
            )

    return LargeBodyResult(
        requests=n,
        small_cpu_ms=small_cpu,
        small_direct_p50_ms=small_direct,
        small_gateway_p50_ms=small_via,
        prompts=cases,
        streams=config.streams,
        token_gap_ms=config.token_gap_ms,
        stream_tokens=config.stream_tokens,
        big_bodies=bigs,
        small_kernel_ms=small_kernel,
    )


async def _big_body_case(
    session: aiohttp.ClientSession,
    gateway: ChildProcess,
    config: LargeBodyConfig,
    kind: str,
    big_body: bytes,
    stream_body: bytes,
    stream_headers: dict[str, str],
    idle: float,
) -> BigBodyCase:
    mb = len(big_body) / 1e6
    progress(f"(b) the {mb:.1f} MB {kind} body alone, 3 times")
    cpu: list[float] = []
    for _ in range(3):
        c0, t0 = cpu_seconds(gateway.pid), time.perf_counter()
        status, _, _ = await asyncio.to_thread(_send_big_body, gateway.url, big_body)
        if status != 200:
            raise RuntimeError(f"the {kind} big body got HTTP {status}")
        cpu.append(_cpu_ms(gateway.pid, c0, t0, idle, 1))
    case = BigBodyCase(
        text=kind,
        body_bytes=len(big_body),
        gateway_cpu_ms=statistics.median(cpu),
        parse_ms=_best_ms(lambda: parse_request("chat", big_body, 1)),
        json_dumps_ms=_dumps_ms(big_body),
    )
    for r in range(config.rounds):
        for with_body in (False, True):
            progress(
                f"(b) {kind} round {r + 1}/{config.rounds}: {config.streams} streams of "
                f"{config.stream_tokens} tokens {config.token_gap_ms:g} ms apart, "
                f"{'with' if with_body else 'without'} the big body"
            )
            result = await _gap_round(
                session,
                gateway,
                config.streams,
                stream_body,
                stream_headers,
                big_body if with_body else None,
                idle,
            )
            if with_body and result.big_body_status != 200:
                raise RuntimeError(f"the big body got HTTP {result.big_body_status} during the streams")
            case.rounds.append(result)
    return case


def _best_ms(work: Callable[[], object], repeat: int = 3) -> float:
    """Least process CPU time of ``repeat`` calls, in ms."""
    return min(_timed_ms(work) for _ in range(repeat))


def _prefix_key_ms(raw: bytes) -> tuple[float, float]:
    """CPU to key ``raw``'s prompt for the prefix index (what the front door does per request
    when the routing profile reads prefix matches): with an empty per-message cache (a prompt
    never seen), and for the conversation's next turn (least of five each)."""
    body = orjson.loads(raw)
    messages = body["messages"]
    turn = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more " * 200}]

    def key(msgs: list[dict[str, object]], cache: MessageTokens) -> None:
        blocks = prompt_blocks(body["model"], chat_token_ids(msgs, cache))
        assert blocks is not None
        blocks.hashes(16)

    fresh = min(_timed_ms(lambda: key(messages, MessageTokens())) for _ in range(5))
    cache = MessageTokens()
    key(messages, cache)
    next_turn = min(_timed_ms(lambda: key(turn, cache)) for _ in range(5))
    return fresh, next_turn


def _dumps_ms(raw: bytes) -> float:
    """orjson.dumps of a freshly parsed ``raw`` (least of three). Fresh, because CPython keeps a
    string's UTF-8 form once asked for it: only the first dumps of a non-ASCII string encodes."""
    best = float("inf")
    for _ in range(3):
        parsed = orjson.loads(raw)
        best = min(best, _timed_ms(lambda: orjson.dumps(parsed)))  # noqa: B023 (called at once)
    return best


def _timed_ms(work: Callable[[], object]) -> float:
    c0 = time.process_time()
    work()
    return (time.process_time() - c0) * 1e3


def run_large_body(config: LargeBodyConfig | None = None) -> LargeBodyResult:
    """Start the engines and the gateway, measure, stop them all. Blocking."""
    config = config or LargeBodyConfig()
    big_bodies: dict[str, bytes] = {}
    for kind in config.big_texts:
        progress(f"building a {config.big_bytes / 1e6:.1f} MB {kind} request body")
        big_bodies[kind] = _chat_body(SINK_MODEL, _text_of_bytes(kind, config.big_bytes), stream=True)
    # room for the big bodies whatever the default limit is
    largest = max((len(b) for b in big_bodies.values()), default=0)
    env = {"SLOGATE_MAX_BODY_BYTES": str(max(16 * 1024 * 1024, 2 * largest))}
    progress("starting a paced engine, a sink engine and a single-worker gateway")
    with tempfile.TemporaryDirectory(prefix="slogate-bench-") as tmp:
        profile = paced_profile(Path(tmp), config.token_gap_ms / 1e3)
        with (
            spawn_paced_engine(PACED_MODEL, profile) as paced,
            spawn_sink(SINK_MODEL) as sink,
        ):
            engines = [
                engine_entry(paced, PACED_MODEL),
                engine_entry(sink, SINK_MODEL, kind="openai"),
            ]
            with spawn_gateway(engines, env) as gateway:
                return asyncio.run(_measure(config, sink, gateway, big_bodies))


def render_table(result: LargeBodyResult) -> str:
    lines = checks_table(result.checks())
    for big in result.big_bodies:
        per_round = ", ".join(f"{r.max_gap_ms:.1f}{'*' if r.big_body else ''}" for r in big.rounds)
        lines.append(f"({big.text}: largest gap per round in ms, * = with the big body: {per_round})")
    lines.append(
        f"({result.requests} requests per (a) case; {result.streams} streams of {result.stream_tokens} "
        f"tokens {result.token_gap_ms:g} ms apart; CPU less the gateway's idle rate)"
    )
    return "\n".join(lines)


def to_json(result: LargeBodyResult) -> dict[str, object]:
    data = asdict(result)
    for case, big in zip(data["big_bodies"], result.big_bodies, strict=True):
        case.update(
            max_gap_without_ms=big.max_gap_without_ms,
            max_gap_with_ms=big.max_gap_with_ms,
            added_gap_ms=big.added_gap_ms,
        )
    data["checks"] = [{"figure": a, "measured": b, "target": c, "met": ok} for a, b, c, ok in result.checks()]
    return data


# -- the prefix-index key alone (--key-only) ------------------------------------------------------


@dataclass
class PrefixKeyCase:
    """Keying one prompt for the prefix index in this process: a one-message chat never seen (an
    empty per-message cache), and its next turn (the history cached, a 1 KB new message). Each
    figure is the least thread CPU of its tries, so ``encode_ms + chain_ms`` can differ from
    ``total_ms`` by the noise."""

    text: str
    chars: int
    utf8_bytes: int
    tokens: int
    blocks: int
    encode_ms: float
    chain_ms: float
    total_ms: float
    turn_ms: float
    #: keyed afresh, matched on 4 engines that all hold it (the lookup's worst case) and recorded
    #: as dispatched
    match_ms: float = 0.0


def prefix_key_case(kind: str, text: str, repeat: int, block_size: int = 16) -> PrefixKeyCase:
    messages = [{"role": "user", "content": text}]
    turn = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more " * 200}]
    encode = chain = total = turn_ms = float("inf")
    tokens = keys = None
    for _ in range(repeat):
        t0 = time.thread_time()
        tokens = chat_token_ids(messages, MessageTokens())
        t1 = time.thread_time()
        blocks = prompt_blocks(MODEL, tokens)
        assert blocks is not None
        keys = blocks.hashes(block_size)
        t2 = time.thread_time()
        encode, chain, total = min(encode, t1 - t0), min(chain, t2 - t1), min(total, t2 - t0)
    cache = MessageTokens()
    chat_token_ids(messages, cache)
    for _ in range(repeat):
        t0 = time.thread_time()
        blocks = prompt_blocks(MODEL, chat_token_ids(turn, cache))
        assert blocks is not None
        blocks.hashes(block_size)
        turn_ms = min(turn_ms, time.thread_time() - t0)
    assert tokens is not None and keys is not None
    engines = ("a", "b", "c", "d")
    index = PrefixIndex(1 << 28, 60.0)
    for engine in engines:
        index.add_engine(engine, MODEL, block_size)
        held = prompt_blocks(MODEL, tokens)
        assert held is not None
        index.record_dispatch(engine, held, now=0.0)
    match = float("inf")
    for i in range(repeat):
        t0 = time.thread_time()
        blocks = prompt_blocks(MODEL, tokens)
        assert blocks is not None
        index.match(blocks, engines)
        index.record_dispatch("a", blocks, now=1.0 + i)
        match = min(match, time.thread_time() - t0)
    return PrefixKeyCase(
        text=kind,
        chars=len(text),
        utf8_bytes=len(text.encode("utf-8", "surrogatepass")),
        tokens=len(tokens),
        blocks=len(keys),
        encode_ms=encode * 1e3,
        chain_ms=chain * 1e3,
        total_ms=total * 1e3,
        turn_ms=turn_ms * 1e3,
        match_ms=match * 1e3,
    )


def run_prefix_key(config: LargeBodyConfig, repeat: int) -> list[PrefixKeyCase]:
    cases = []
    for kind in config.prompt_texts:
        progress(f"prefix-index key of a {kind} prompt, {repeat} tries")
        cases.append(prefix_key_case(kind, _prompt_text(kind, config), repeat))
    return cases


def prefix_key_checks(cases: list[PrefixKeyCase]) -> list[tuple[str, str, str, bool]]:
    rows: list[tuple[str, str, str, bool]] = []
    for c in cases:
        size = f"{c.utf8_bytes / 1000:.0f} KB {c.text} prompt ({c.chars:,} characters, {c.tokens:,} tokens)"
        rows += [
            (
                f"{size}: prefix-index key, fresh prompt",
                f"{c.total_ms:.3f} ms (tokens {c.encode_ms:.3f}, {c.blocks:,} block hashes {c.chain_ms:.3f})",
                "<= 2 ms",
                c.total_ms <= 2.0,
            ),
            (
                "  prefix-index key, next turn (history cached, 1 KB new message)",
                f"{c.turn_ms:.3f} ms",
                "<= 2 ms",
                c.turn_ms <= 2.0,
            ),
            (
                "  key + match on 4 engines holding it all + record the dispatch",
                f"{c.match_ms:.3f} ms",
                "<= 4 ms",
                c.match_ms <= 4.0,
            ),
        ]
    return rows


def _key_only_main(args: argparse.Namespace, config: LargeBodyConfig) -> int:
    cases = run_prefix_key(config, args.key_repeat)
    checks = prefix_key_checks(cases)
    print("\n".join(checks_table(checks)))
    print(f"(least thread CPU of {args.key_repeat} tries each, in this process; block size 16)")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"large-body-key-{time.strftime('%Y%m%d-%H%M%S')}.json"
    data = {
        "repeat": args.key_repeat,
        "prompts": [asdict(c) for c in cases],
        "checks": [{"figure": a, "measured": b, "target": c, "met": ok} for a, b, c, ok in checks],
    }
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
    return 0


def add_large_body_arguments(parser: argparse.ArgumentParser) -> None:
    d = LargeBodyConfig()
    parser.add_argument("--requests", type=int, default=d.requests, help="requests per case in (a)")
    parser.add_argument(
        "--prompt-bytes", type=int, default=d.prompt_bytes, help="UTF-8 bytes of (a)'s prompts"
    )
    parser.add_argument(
        "--prompt-chars",
        type=int,
        default=None,
        help="(a)'s prompts of this many characters instead (non-ASCII takes 2-4 bytes a character)",
    )
    parser.add_argument(
        "--prompt-texts",
        type=_kinds,
        default=d.prompt_texts,
        help=f"(a)'s prompt texts, comma-separated, of {', '.join(sorted(GENERATORS))} "
        "(default english,mixed)",
    )
    parser.add_argument(
        "--key-only",
        action="store_true",
        help="only the prefix-index key of (a)'s prompts (tokens, block hashes), in this process",
    )
    parser.add_argument(
        "--key-repeat", type=int, default=50, help="tries per --key-only figure (least counts)"
    )
    parser.add_argument("--streams", type=int, default=d.streams, help="concurrent streams in (b)")
    parser.add_argument("--token-gap-ms", type=float, default=d.token_gap_ms, help="engine pacing in (b)")
    parser.add_argument("--stream-tokens", type=int, default=d.stream_tokens, help="tokens per stream in (b)")
    parser.add_argument("--big-bytes", type=int, default=d.big_bytes, help="size of (b)'s big body")
    parser.add_argument(
        "--big-texts",
        type=_kinds,
        default=d.big_texts,
        help=f"big body texts, comma-separated, of {', '.join(sorted(GENERATORS))} (default english,mixed)",
    )
    parser.add_argument(
        "--rounds", type=int, default=d.rounds, help="(b) rounds with and without the big body"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help=f"where the JSON goes ({DEFAULT_RESULTS_DIR})",
    )


def _kinds(value: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    unknown = [k for k in kinds if k not in GENERATORS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown text kinds {unknown}; known: {', '.join(sorted(GENERATORS))}"
        )
    return kinds


def bench_large_body_main(args: argparse.Namespace) -> int:
    config = LargeBodyConfig(
        requests=args.requests,
        prompt_bytes=args.prompt_bytes,
        prompt_chars=args.prompt_chars,
        prompt_texts=args.prompt_texts,
        streams=args.streams,
        token_gap_ms=args.token_gap_ms,
        stream_tokens=args.stream_tokens,
        big_bytes=args.big_bytes,
        big_texts=args.big_texts,
        rounds=args.rounds,
    )
    if args.key_only:
        return _key_only_main(args, config)
    result = run_large_body(config)
    print(render_table(result))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"large-body-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(to_json(result), indent=2))
    print(f"wrote {path}")
    return 0
