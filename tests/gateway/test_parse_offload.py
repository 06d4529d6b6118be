"""Large bodies are parsed in a worker process: the same answer as parsing in place, errors included."""

from __future__ import annotations

import orjson
import pytest

from gateway.api import parse_offload as offload
from gateway.api.errors import GatewayError
from gateway.api.parse_offload import BodyParser
from gateway.api.request_parse import parse_request
from gateway.serving.call import Call
from tests.gateway.test_body_splice import TARGET, _noop, flow, record


async def test_a_large_body_parsed_in_the_worker_matches_parsing_in_place() -> None:
    text = "the quick brown fox jumps over the lazy dog; " * 60_000  # ~2.7 MB
    raw = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 7}
    )
    parser = BodyParser(threshold=1024 * 1024, default_max_tokens=16)
    try:
        # the first large body starts the worker and, rather than wait for it, is parsed here
        first = await parser.parse("chat", raw)
        assert first.parsed is not None and parser._pool is not None
        assert await parser.started()
        offloaded = await parser.parse("chat", raw)
        here = parse_request("chat", raw, 16)
        assert offloaded.parsed is None and offloaded.raw is raw
        for field in (
            "kind",
            "model",
            "stream",
            "client_wants_usage",
            "max_tokens",
            "prompt_tokens",
            "priority",
        ):
            assert getattr(offloaded, field) == getattr(here, field), field
        assert offloaded.keys == frozenset(here.body)
        # the forwarded bytes are spliced without decoding the body on the event loop
        call = Call(offloaded, "sg-1", "c", 10.0, _noop, TARGET, None, (), {})
        sent = flow().body_for(call, record("vllm", True))
        assert offloaded.parsed is None and orjson.loads(sent)["stream_options"] == {"include_usage": True}
        assert offloaded.body == here.body  # decoded on first use
        pool = parser._pool
        with pytest.raises(GatewayError) as bad:
            await parser.parse("chat", b'{"model": "m", "messages": "x", "pad": "' + b"a" * 2_000_000 + b'"}')
        assert bad.value.status == 400 and bad.value.param == "messages"
        assert parser._pool is pool  # the worker's error came back whole: the pool did not break
    finally:
        parser.close()


async def test_a_small_body_is_parsed_in_place() -> None:
    parser = BodyParser(threshold=1024 * 1024, default_max_tokens=16)
    request = await parser.parse("chat", b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert parser._pool is None and request.parsed is not None


def test_errors_pickle_whole_subclasses_included() -> None:
    import pickle

    from gateway.api.auth import AuthError

    error = GatewayError(429, "slow down", param="p", code="queue_full", retry_after_s=2.0)
    again = pickle.loads(pickle.dumps(error))
    assert (again.status, again.message, again.param, again.code, again.retry_after_s) == (
        429,
        "slow down",
        "p",
        "queue_full",
        2.0,
    )
    auth = pickle.loads(pickle.dumps(AuthError(401, "who are you")))
    assert isinstance(auth, AuthError) and auth.headers() == AuthError(401, "who are you").headers()


async def test_without_worker_processes_large_bodies_are_parsed_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gateway.api.parse_offload as offload

    def no_processes(*_: object, **__: object) -> None:
        raise OSError("no /dev/shm here")

    monkeypatch.setattr(offload, "ProcessPoolExecutor", no_processes)
    parser = BodyParser(threshold=10, default_max_tokens=16)
    request = await parser.parse(
        "chat", b'{"model":"m","messages":[{"role":"user","content":"hello there"}]}'
    )
    assert request.model == "m" and request.parsed is not None


async def test_a_worker_that_dies_while_idle_is_replaced_not_given_up() -> None:
    """The worker is killed between two large bodies (the OOM killer, an operator): the next
    submit fails at once with a broken pool, which used to turn the worker off for good and
    leave every later large body to stall the event loop."""
    import asyncio
    import os
    import signal

    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 100 + b'"}]}'
    parser = BodyParser(threshold=10, default_max_tokens=16)
    try:
        await parser.parse("chat", body)
        assert await parser.started()
        assert (await parser.parse("chat", body)).parsed is None  # in the worker
        pool = parser._pool
        assert pool is not None
        for pid in list(pool._processes):  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        request = await parser.parse("chat", body)  # parsed here, and the dead pool dropped
        assert request.model == "m" and not parser._disabled and parser._pool is None
        await parser.parse("chat", body)  # a new worker starts (and this one is parsed here)
        assert await parser.started() and parser._pool is not pool
        assert (await parser.parse("chat", body)).parsed is None
    finally:
        parser.close()


async def test_a_worker_that_keeps_dying_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures.process import BrokenProcessPool

    class Broken:
        def __init__(self, *_: object, **__: object) -> None:
            pass

        def submit(self, *_: object, **__: object) -> None:
            raise BrokenProcessPool("died")

        def shutdown(self, *_: object, **__: object) -> None:
            pass

    monkeypatch.setattr(offload, "ProcessPoolExecutor", Broken)
    parser = BodyParser(threshold=10, default_max_tokens=16)
    body = b'{"model":"m","messages":[{"role":"user","content":"hello there"}]}'
    for _ in range(offload.MAX_DEATHS):
        assert not parser._disabled
        assert (await parser.parse("chat", body)).model == "m"
    assert parser._disabled


async def test_one_death_is_counted_once_however_many_bodies_were_queued() -> None:
    """Every body queued on the worker when it dies is told so: each counted a death, so one
    death with three bodies in flight turned the worker off for good."""
    import asyncio
    import os
    import signal

    text = "the quick brown fox jumps over the lazy dog; " * 200_000  # ~9 MB: a parse takes a while
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    parser = BodyParser(threshold=1024, default_max_tokens=16)
    try:
        await parser.parse(
            "chat", b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 2000 + b'"}]}'
        )
        assert await parser.started()
        pool = parser._pool
        assert pool is not None
        queued = [asyncio.create_task(parser.parse("chat", body)) for _ in range(3)]
        await asyncio.sleep(0.05)
        for pid in list(pool._processes):  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
        answers = await asyncio.gather(*queued)
        assert all(a.model == "m" for a in answers)
        # (the bodies take long enough to parse that the kill lands while they are queued)
        assert parser._deaths == 1 and not parser._disabled and parser._pool is not pool
    finally:
        parser.close()


def test_a_gateway_killed_outright_takes_its_parse_worker_with_it() -> None:
    """Killed with SIGKILL (or by the OOM killer), the gateway left its parse worker running for
    good, adopted by init: nothing told it its parent was gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import asyncio, os, sys\n"
        "from gateway.api.parse_offload import BodyParser\n"
        "async def main():\n"
        "    parser = BodyParser(threshold=1024, default_max_tokens=16)\n"
        '    raw = b\'{"model": "m", "prompt": "\' + b\'a\' * 4096 + b\'"}\'\n'
        "    await parser.parse('completions', raw)\n"
        "    await parser.started()\n"
        "    print(*parser._pool._processes, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert workers and all(os.path.exists(f"/proc/{pid}") for pid in workers)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split(") ", 1)[1][:1] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:  # (never leave one behind, whatever the outcome)
        os.kill(pid, signal.SIGKILL)
    assert not left


async def test_a_burst_of_large_bodies_is_keyed_one_at_a_time_and_the_rest_parsed_without() -> None:
    """The worker parses one body at a time, and keying one with an engine's tokenizer takes up
    to seconds: the bodies behind a burst waited for every key before their routing fields came
    back. Past MAX_KEYING at once, a body comes back without its key (routed without prefix
    credit, and counted), soon after the key being computed; with the gateway's own encoder (no
    engine tokenizers), which takes milliseconds, every one is keyed."""
    import asyncio

    from gateway import metrics

    text = "the quick brown fox jumps over the lazy dog; " * 40_000
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    # (model x has an engine tokenizer; none is on disk here, and m is keyed with the gateway's
    # own, by the same path and bound)
    parser = BodyParser(
        threshold=1024, default_max_tokens=16, prompt_ids=True, engine_tokenizers={"x": "/none"}
    )
    plain = BodyParser(threshold=1024, default_max_tokens=16, prompt_ids=True)
    small = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 2000 + b'"}]}'
    try:
        for each in (parser, plain):
            await each.parse("chat", small)
            assert await each.started()
        skipped = metrics.REGISTRY.get_sample_value("slogate_prefix_keys_skipped_total") or 0.0
        burst = await asyncio.gather(*(parser.parse("chat", raw) for _ in range(4)))
        keyed = [r.prompt_ids is not None for r in burst]
        assert keyed[0] and keyed.count(True) == offload.MAX_KEYING, keyed
        assert metrics.REGISTRY.get_sample_value("slogate_prefix_keys_skipped_total") == skipped + 3
        assert parser._keying == 0
        alone = await parser.parse("chat", raw)  # (the burst over: keyed again)
        assert alone.prompt_ids is not None and len(alone.prompt_ids) > 0
        burst = await asyncio.gather(*(plain.parse("chat", raw) for _ in range(4)))
        assert all(r.prompt_ids is not None for r in burst)
    finally:
        parser.close()
        plain.close()
