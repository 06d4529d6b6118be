"""A model's own Hugging Face tokenizer keys its prompts for the prefix index: the ids are what
``tokenizers`` itself gives for the rendered chat template (chat) or the prompt (completions),
anything it cannot reproduce is left unkeyed (None, never an exception), and the front door uses
it for the models configured, inline, in a thread and in the parsing worker alike.

The tokenizers here are trained in the test (a small byte-level BPE), nothing is downloaded."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gateway import metrics
from gateway.api.parse_offload import BodyParser
from gateway.api.request_parse import parse_summary
from gateway.app import Gateway
from gateway.bench.texts import english_text
from gateway.fleet import engine_tokenizer as et
from gateway.fleet.engine_tokenizer import (
    INLINE_BYTES,
    EngineTokenizer,
    PromptKeyer,
    engine_prompt_token_ids,
    load,
)
from gateway.fleet.prompt_key import prompt_token_ids
from gateway.procs import ChildProcess, spawn_sim_engine
from gateway.settings import load_settings
from tests.gateway.conftest import MODEL, SIM_ARGS, engine_entry
from tests.gateway.gateway_thread import RunningGateway, run_gateway, wait_until

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: a template that iterates over a message's content parts (vLLM's "openai" content format),
#: starts with the BOS variable and refuses a role it does not know
PARTS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "[{{ message['role'] }}]"
    "{% for part in message['content'] %}{{ part['text'] }}|{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _train(seed_text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([english_text(20_000, seed=s) for s in range(3)] + [seed_text], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ChatML model directory as transformers 4 saves it: the template in tokenizer_config.json,
    and a post-processor that puts ``<s>`` before every encoded text with special tokens."""
    out = tmp_path_factory.mktemp("chatml")
    tok = _train("hello there")
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def parts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers 5's layout: the template in chat_template.jinja (it wins over the config's)."""
    out = tmp_path_factory.mktemp("parts")
    _train("hello").save(str(out / "tokenizer.json"))
    config = {"chat_template": [{"name": "default", "template": CHATML}], "bos_token": "<s>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(PARTS)
    return out


def _chatml_text(messages: list[dict[str, str]], generation: bool = True) -> str:
    """The ChatML rendering, written out by hand."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation else "")


def _encode(directory: Path, text: str, special: bool = False) -> list[int]:
    ids: list[int] = (
        Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=special).ids
    )
    return ids


def _ids(value: np.ndarray[Any, Any] | None) -> list[int]:
    assert value is not None
    assert value.dtype == np.uint64
    out: list[int] = value.tolist()
    return out


# -- chat ----------------------------------------------------------------------------------------


def test_a_chat_is_the_tokenizer_s_encoding_of_the_rendered_template(chatml_dir: Path) -> None:
    tok = EngineTokenizer(chatml_dir)
    messages = [
        {"role": "system", "content": english_text(3_000, seed=5)},
        {"role": "user", "content": "hello there, <|im_end|> is a token\n\nand  spaces é 中 🙂"},
    ]
    ids = _ids(tok.prompt_token_ids("chat", {"messages": messages}))
    assert ids == _encode(chatml_dir, _chatml_text(messages))
    start = Tokenizer.from_file(str(chatml_dir / "tokenizer.json")).token_to_id("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3  # special tokens are single ids, no BOS added
    # the body's add_generation_prompt (vLLM's extension)
    body = {"messages": messages, "add_generation_prompt": False}
    assert _ids(tok.prompt_token_ids("chat", body)) == _encode(chatml_dir, _chatml_text(messages, False))
    # text parts are joined with a newline, as vLLM does for a template that reads content whole
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "here"}]}
    ]
    assert _ids(tok.prompt_token_ids("chat", {"messages": parts})) == _encode(
        chatml_dir, _chatml_text([{"role": "user", "content": "look\nhere"}])
    )
    # a developer message becomes a system one when the template does not know the role
    dev = [{"role": "developer", "content": "be brief"}]
    assert _ids(tok.prompt_token_ids("chat", {"messages": dev})) == _encode(
        chatml_dir, _chatml_text([{"role": "system", "content": "be brief"}])
    )


def test_the_jinja_file_wins_and_content_parts_reach_a_template_that_iterates_them(parts_dir: Path) -> None:
    tok = EngineTokenizer(parts_dir)
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]
    expected = "<s>[system]rules|[user]one|two|[assistant]"
    assert _ids(tok.prompt_token_ids("chat", {"messages": messages})) == _encode(parts_dir, expected)
    # the body's chat_template_kwargs reach the template, but cannot replace its inputs
    body = {"messages": messages, "chat_template_kwargs": {"bos_token": "", "add_generation_prompt": False}}
    assert _ids(tok.prompt_token_ids("chat", body)) == _encode(parts_dir, expected.removeprefix("<s>"))


# -- completions ---------------------------------------------------------------------------------


def test_completions_prompts(chatml_dir: Path) -> None:
    tok = EngineTokenizer(chatml_dir)
    text = "once upon a time " * 50
    with_bos = _ids(tok.prompt_token_ids("completions", {"prompt": text}))
    assert with_bos == _encode(chatml_dir, text, special=True)
    assert with_bos[0] == Tokenizer.from_file(str(chatml_dir / "tokenizer.json")).token_to_id("<s>")
    plain = {"prompt": text, "add_special_tokens": False}
    plain_ids = _encode(chatml_dir, text)
    assert _ids(tok.prompt_token_ids("completions", plain)) == plain_ids
    # a batch is keyed by its first prompt; token ids are taken as they are
    assert _ids(tok.prompt_token_ids("completions", {"prompt": [text, "other"]})) == with_bos
    assert _ids(tok.prompt_token_ids("completions", {"prompt": [5, 6, 7]})) == [5, 6, 7]
    assert _ids(tok.prompt_token_ids("completions", {"prompt": [[8, 9], [1]]})) == [8, 9]
    # truncate_prompt_tokens: the engine keeps the last k tokens, and so does the key; vLLM
    # truncates inside the tokenizer, its BOS counted in the k and kept, which the last k of
    # the encoding are not: such a prompt is not keyed
    cut = {"prompt": text, "truncate_prompt_tokens": 5}
    assert tok.prompt_token_ids("completions", cut) is None
    assert _ids(tok.prompt_token_ids("completions", {**cut, "add_special_tokens": False})) == plain_ids[-5:]
    ids = {"prompt": list(range(1, 9)), "truncate_prompt_tokens": 2}
    assert _ids(tok.prompt_token_ids("completions", ids)) == [7, 8]
    chat = {"messages": [{"role": "user", "content": text}]}
    whole = _ids(tok.prompt_token_ids("chat", chat))
    assert _ids(tok.prompt_token_ids("chat", {**chat, "truncate_prompt_tokens": 9})) == whole[-9:]
    # a chat's add_special_tokens (false by default in vLLM's chat API): true adds the BOS the
    # tokenizer's post-processor puts first, on top of the template's tokens
    bos = Tokenizer.from_file(str(chatml_dir / "tokenizer.json")).token_to_id("<s>")
    assert _ids(tok.prompt_token_ids("chat", {**chat, "add_special_tokens": True})) == [bos, *whole]
    assert _ids(tok.prompt_token_ids("chat", {**chat, "add_special_tokens": False})) == whole
    assert tok.prompt_token_ids("chat", {**chat, "add_special_tokens": "yes"}) is None
    cut_chat = {**chat, "add_special_tokens": True, "truncate_prompt_tokens": 9}
    assert tok.prompt_token_ids("chat", cut_chat) is None


# -- what it does not reproduce ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("chat", {"messages": "hello"}),
        ("chat", {"messages": []}),
        ("chat", {"messages": ["hello"]}),
        ("chat", {"messages": [{"content": "no role"}]}),
        ("chat", {"messages": [{"role": "user", "content": 42}]}),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        ),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "yes"}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]}),
        ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}),  # a lone surrogate
        ("completions", {"prompt": ""}),
        ("completions", {"prompt": [-1, 2]}),
        ("completions", {"prompt": "hi", "add_special_tokens": "no"}),
        ("completions", {"prompt": {"text": "hi"}}),
        ("embeddings", {"input": "hi"}),
    ],
)
def test_what_it_cannot_reproduce_is_not_keyed(chatml_dir: Path, kind: str, body: dict[str, Any]) -> None:
    assert EngineTokenizer(chatml_dir).prompt_token_ids(kind, body) is None


def test_a_template_that_raises_and_a_missing_template_leave_the_chat_unkeyed(
    parts_dir: Path, tmp_path: Path
) -> None:
    tok = EngineTokenizer(parts_dir)
    assert tok.prompt_token_ids("chat", {"messages": [{"role": "tool", "content": "x"}]}) is None
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((parts_dir / "tokenizer.json").read_text())
    untemplated = EngineTokenizer(bare)
    assert untemplated.prompt_token_ids("chat", {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert _ids(untemplated.prompt_token_ids("completions", {"prompt": "hi"})) == _encode(parts_dir, "hi")


def test_models_without_an_engine_tokenizer_keep_the_gateway_s(chatml_dir: Path, tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    tokenizers = {"hf-model": str(chatml_dir)}
    gateway_ids = prompt_token_ids("chat", body)
    assert gateway_ids is not None
    assert _ids(engine_prompt_token_ids("chat", body, "other", tokenizers)) == gateway_ids.tolist()
    assert _ids(engine_prompt_token_ids("chat", body, "other", None)) == gateway_ids.tolist()
    hf = _ids(engine_prompt_token_ids("chat", body, "hf-model", tokenizers))
    assert hf == _encode(chatml_dir, _chatml_text(body["messages"])) and hf != gateway_ids.tolist()
    # a directory that cannot be loaded (removed after start-up): not keyed, no exception
    assert engine_prompt_token_ids("chat", body, "gone", {"gone": str(tmp_path / "nothing")}) is None
    assert load(str(tmp_path / "nothing")) is None


# -- the front door's paths ---------------------------------------------------------------------


async def test_the_keyer_keys_large_bodies_in_a_thread(chatml_dir: Path) -> None:
    await et.preload({"hf-model": chatml_dir})  # as the app's start-up does
    keyer = PromptKeyer({"hf-model": chatml_dir})
    messages = [{"role": "user", "content": english_text(50_000, seed=9)}]
    expected = _encode(chatml_dir, _chatml_text(messages))
    try:
        small = await keyer.token_ids_async("chat", {"messages": messages}, "hf-model", INLINE_BYTES)
        assert keyer._pool is None and _ids(small) == expected
        large = await keyer.token_ids_async("chat", {"messages": messages}, "hf-model", 60_000)
        assert keyer._pool is not None and _ids(large) == expected
        # other models: the gateway's tokenizer, in place
        other = await keyer.token_ids_async("chat", {"messages": messages}, "m", 60_000)
        gateway_ids = prompt_token_ids("chat", {"messages": messages})
        assert gateway_ids is not None and _ids(other) == gateway_ids.tolist()
    finally:
        keyer.close()


async def test_the_parsing_worker_keys_with_the_engine_tokenizer(chatml_dir: Path) -> None:
    messages = [{"role": "user", "content": english_text(5_000, seed=3)}]
    raw = orjson.dumps({"model": "hf-model", "messages": messages})
    expected = _encode(chatml_dir, _chatml_text(messages))
    summary = parse_summary("chat", raw, 16, prompt_ids=True, engine_tokenizers={"hf-model": str(chatml_dir)})
    assert _ids(summary.prompt_ids) == expected
    parser = BodyParser(1024, 16, prompt_ids=True, engine_tokenizers={"hf-model": str(chatml_dir)})
    try:
        await parser.parse("chat", raw)  # (parsed here while the worker starts)
        assert await parser.started()
        offloaded = await parser.parse("chat", raw)
        assert offloaded.parsed is None
        assert _ids(offloaded.prompt_ids) == expected
    finally:
        parser.close()


def _copy(directory: Path, tmp_path: Path) -> Path:
    """A copy of a model directory: a path no test has loaded yet (tokenizers are cached by it)."""
    return Path(shutil.copytree(directory, tmp_path / "copy"))


# -- loading: at start-up, never on the event loop -----------------------------------------------


async def test_start_up_loads_and_compiles_so_no_request_does(
    chatml_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _copy(chatml_dir, tmp_path)
    await et.preload({"hf-model": directory})

    def nothing_more(*_: Any) -> None:
        raise AssertionError("loaded or compiled after start-up")

    monkeypatch.setattr(et.EngineTokenizer, "__init__", nothing_more)
    monkeypatch.setattr(et, "_compile", nothing_more)
    monkeypatch.setattr(et, "_iterates_content", nothing_more)
    messages = [{"role": "user", "content": "hello there"}]
    keyer = PromptKeyer({"hf-model": directory})
    try:
        ids = await keyer.token_ids_async("chat", {"messages": messages}, "hf-model", INLINE_BYTES)
        assert _ids(ids) == _encode(chatml_dir, _chatml_text(messages))
        assert keyer._pool is None  # keyed inline: the tokenizer was ready
    finally:
        keyer.close()


async def test_a_tokenizer_not_loaded_yet_is_loaded_in_a_thread_never_on_the_loop(
    chatml_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _copy(chatml_dir, tmp_path)
    threads: list[str] = []
    real_init = et.EngineTokenizer.__init__

    def init(self: et.EngineTokenizer, path: Any) -> None:
        threads.append(threading.current_thread().name)
        real_init(self, path)

    monkeypatch.setattr(et.EngineTokenizer, "__init__", init)
    messages = [{"role": "user", "content": "hello there"}]
    keyer = PromptKeyer({"hf-model": directory})
    try:
        ids = await keyer.token_ids_async("chat", {"messages": messages}, "hf-model", 100)
        assert _ids(ids) == _encode(chatml_dir, _chatml_text(messages))
        assert len(threads) == 1 and threads[0].startswith("engine-tokenizer"), threads
        # loaded now: the next small body is keyed inline, without loading again
        again = await keyer.token_ids_async("chat", {"messages": messages}, "hf-model", 100)
        assert _ids(again) == _ids(ids) and len(threads) == 1
    finally:
        keyer.close()


async def test_a_tokenizer_that_cannot_be_loaded_stops_start_up(chatml_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(et.EngineTokenizerError, match=r"engine_tokenizers\.bad: .*broken cannot be loaded"):
        await et.preload({"good": chatml_dir, "bad": broken})
    # a chat template that does not compile is the load's failure too, not each request's
    bad_template = _copy(chatml_dir, tmp_path)
    (bad_template / "chat_template.jinja").write_text("{% for message in %}")
    with pytest.raises(et.EngineTokenizerError, match=r"engine_tokenizers\.m: .*TemplateSyntaxError"):
        await et.preload({"m": bad_template})
    # the gateway does not start with it (before it connects to anything)
    gateway = Gateway(load_settings(engine_tokenizers={MODEL: str(broken)}))
    try:
        with pytest.raises(et.EngineTokenizerError, match=rf"engine_tokenizers\.{MODEL}: "):
            await gateway.start()
        assert gateway.session is None and gateway.proxy is None
    finally:
        await gateway.stop()


# -- Rust panics ---------------------------------------------------------------------------------

#: what pyo3 raises for a Rust panic: ``pyo3_runtime.PanicException``, a BaseException
PanicException = type("PanicException", (BaseException,), {"__module__": "pyo3_runtime"})


async def test_a_panic_in_the_tokenizer_leaves_the_request_unkeyed(
    chatml_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def panic(*_: Any, **__: Any) -> None:
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(et.EngineTokenizer, "encode", panic)
    tok = EngineTokenizer(chatml_dir)
    chat = {"messages": [{"role": "user", "content": "hello there"}]}
    assert tok.prompt_token_ids("chat", chat) is None
    assert tok.prompt_token_ids("completions", {"prompt": "hello"}) is None
    # through the front door's paths, inline and in the thread
    await et.preload({"hf-model": chatml_dir})
    keyer = PromptKeyer({"hf-model": chatml_dir})
    try:
        assert await keyer.token_ids_async("chat", chat, "hf-model", 100) is None
        assert await keyer.token_ids_async("chat", chat, "hf-model", 60_000) is None
    finally:
        keyer.close()
    assert engine_prompt_token_ids("chat", chat, "hf-model", {"hf-model": str(chatml_dir)}) is None

    # other BaseExceptions are not swallowed
    def interrupt(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(et.EngineTokenizer, "encode", interrupt)
    with pytest.raises(KeyboardInterrupt):
        tok.prompt_token_ids("chat", chat)

    # a panic while loading: not keyed at run time, a configuration error at start-up
    monkeypatch.setattr(et.EngineTokenizer, "__init__", panic)
    directory = _copy(chatml_dir, tmp_path)
    with pytest.raises(et.EngineTokenizerError, match="PanicException"):
        await et.preload({"m": directory})
    assert load(str(directory)) is None


# -- the bound on waiting keying jobs ------------------------------------------------------------


async def test_keying_jobs_waiting_past_the_bound_are_not_keyed(
    chatml_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past :data:`MAX_WAITING` jobs waiting for a keying thread a large request is not keyed (None:
    routed by load) and counted; a request gone while it waited frees its place."""
    gate = threading.Event()
    real = et.engine_prompt_token_ids

    def held(*args: Any) -> Any:
        gate.wait(60)
        return real(*args)

    monkeypatch.setattr(et, "engine_prompt_token_ids", held)
    messages = [{"role": "user", "content": english_text(2_000, seed=4)}]
    body = {"messages": messages}
    expected = _encode(chatml_dir, _chatml_text(messages))
    full = et._THREADS + et.MAX_WAITING  # running + waiting

    def skipped() -> float:
        return metrics.REGISTRY.get_sample_value("slogate_prefix_keys_skipped_total") or 0.0

    async def until(predicate: Any) -> None:
        for _ in range(10_000):
            if predicate():
                return
            await asyncio.sleep(0)
        raise AssertionError("never")

    await et.preload({"hf-model": chatml_dir})
    keyer = PromptKeyer({"hf-model": chatml_dir})
    try:
        jobs = [
            asyncio.create_task(keyer.token_ids_async("chat", body, "hf-model", 60_000)) for _ in range(full)
        ]
        await until(lambda: keyer._in_flight == full)
        before = skipped()
        assert await keyer.token_ids_async("chat", body, "hf-model", 60_000) is None
        assert skipped() == before + 1
        # small bodies are keyed inline, not bounded
        assert _ids(await keyer.token_ids_async("chat", body, "hf-model", 100)) == expected
        # the last one waiting goes away (its client did): its place is free again
        jobs[-1].cancel()
        await until(lambda: keyer._in_flight == full - 1)
        jobs[-1] = asyncio.create_task(keyer.token_ids_async("chat", body, "hf-model", 60_000))
        await until(lambda: keyer._in_flight == full)
        gate.set()
        results = await asyncio.gather(*jobs)
        assert all(_ids(r) == expected for r in results)
        assert keyer._in_flight == 0 and skipped() == before + 1
        assert _ids(await keyer.token_ids_async("chat", body, "hf-model", 60_000)) == expected
    finally:
        gate.set()
        keyer.close()


def test_settings_check_the_directories(chatml_dir: Path, tmp_path: Path) -> None:
    settings = load_settings(engine_tokenizers={"m": str(chatml_dir)})
    assert settings.engine_tokenizers == {"m": chatml_dir}
    with pytest.raises(ValidationError, match=r"engine_tokenizers\.m: .* has no tokenizer\.json"):
        load_settings(engine_tokenizers={"m": str(tmp_path)})


@pytest.fixture(scope="module")
def sim_engine() -> Iterator[ChildProcess]:
    with spawn_sim_engine(*SIM_ARGS, name="e0") as engine:
        yield engine


def _start_parse_worker(gw: RunningGateway) -> None:
    """Start the gateway's parsing worker and wait until it is up: until then large bodies are
    parsed in place, and these tests are about the worker."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}], "max_tokens": 1}
    assert httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert gw.gateway.proxy is not None
    parser = gw.gateway.proxy.parser
    assert wait_until(lambda: parser._warm_up is not None and parser._warm_up.done(), timeout=30)


@pytest.mark.parametrize("offload", [False, True])
def test_the_front_door_keys_a_configured_model_with_its_tokenizer(
    sim_engine: ChildProcess, chatml_dir: Path, offload: bool
) -> None:
    """The routing decision's prompt length is the engine tokenizer's, for a body keyed inline, in
    the thread (a large one) and in the parsing worker (``offload``)."""
    overrides: dict[str, Any] = {"offload_parse_bytes": 1024} if offload else {}
    with run_gateway(
        engines=[engine_entry(sim_engine)],
        routing_profile="prefix-aware",
        engine_tokenizers={MODEL: str(chatml_dir)},
        **overrides,
    ) as gw:
        if offload:
            _start_parse_worker(gw)
        for size in (200, 20_000):
            messages = [{"role": "user", "content": english_text(size, seed=size)}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            r = httpx.post(
                gw.url + "/v1/chat/completions", json=body, headers={"x-slogate-debug": "1"}, timeout=30
            )
            assert r.status_code == 200, r.text
            decision = dict(part.split("=", 1) for part in r.headers["x-slogate-decision"].split("; "))
            expected = _encode(chatml_dir, _chatml_text(messages))
            own = prompt_token_ids("chat", {"messages": messages})
            assert own is not None and len(own) != len(expected)
            assert decision["cached_tokens"] == f"0/{len(expected)}", (size, decision)


@pytest.mark.parametrize("offload", [False, True])
def test_a_lora_adapter_s_prompts_are_keyed_with_its_base_model_s_tokenizer(
    chatml_dir: Path, offload: bool
) -> None:
    """A request naming a LoRA adapter (loaded on an engine of MODEL) is keyed with MODEL's engine
    tokenizer, inline and in the parsing worker (which is told the adapter's base model)."""
    overrides: dict[str, Any] = {"offload_parse_bytes": 1024} if offload else {}
    with (
        spawn_sim_engine(*SIM_ARGS, "--lora-modules", "a1=/adapters/a1", name="e0") as engine,
        run_gateway(
            engines=[engine_entry(engine)],
            routing_profile="prefix-aware",
            engine_tokenizers={MODEL: str(chatml_dir)},
            **overrides,
        ) as gw,
    ):
        if offload:
            _start_parse_worker(gw)
        messages = [{"role": "user", "content": english_text(20_000, seed=5)}]
        body = {"model": "a1", "messages": messages, "max_tokens": 2}
        r = httpx.post(
            gw.url + "/v1/chat/completions", json=body, headers={"x-slogate-debug": "1"}, timeout=30
        )
        assert r.status_code == 200, r.text
        decision = dict(part.split("=", 1) for part in r.headers["x-slogate-decision"].split("; "))
        expected = _encode(chatml_dir, _chatml_text(messages))
        assert decision["cached_tokens"] == f"0/{len(expected)}", decision
