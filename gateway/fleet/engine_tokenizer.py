"""Keying a model's prompts with the model's own Hugging Face tokenizer, as vLLM tokenizes them.

The prefix index matches the blocks the front door keys (``gateway/fleet/prompt_key.py``) against
the blocks engines report in their KV events, which carry the engine's token ids. The gateway's
own tokenizer is the simulated engine's; a real vLLM tokenizes with the model's tokenizer, so
for a model served by real engines the two never agree and the precise feed matches nothing.
``engine_tokenizers`` (settings: served model name -> directory with ``tokenizer.json``) makes
the front door key that model's prompts the way vLLM does:

- chat: the chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
  ``chat_template``) rendered as transformers' ``apply_chat_template`` renders it (a sandboxed
  Jinja environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``,
  ``strftime_now``, the named special tokens as variables), with ``add_generation_prompt``
  (default true) and the body's ``chat_template_kwargs``, ``tools`` and ``documents``; then
  encoded without special tokens (what ``apply_chat_template(tokenize=True)`` does). Messages are
  prepared as vLLM's chat parser prepares them: a content list's text parts joined with ``"\\n"``
  (or kept as ``{"type": "text"}`` parts when the template iterates over a message's content),
  ``name`` kept, ``developer`` turned into ``system`` when the template does not mention it;
- completions: the prompt string encoded with special tokens unless the body says
  ``add_special_tokens: false`` (tokenizer.json's post-processor decides what that adds, as in
  transformers 5), token-id prompts as they are; the first prompt of a batch.

What it cannot reproduce it does not key (None: the request is routed without a prefix match,
never failed): images and other non-text parts, a request's own ``chat_template``,
``continue_final_message``, a template that raises, anything malformed.

Loading: :func:`preload` (the app's start-up, awaited before it serves) loads every configured
tokenizer and compiles its chat templates in threads, so no request ever pays for it on the event
loop (``Tokenizer.from_file`` of a large vocabulary takes hundreds of milliseconds); one that
cannot be loaded then is a configuration error and the gateway does not start. Where nothing
preloaded (the parsing worker process, a directory first seen at run time), :func:`load` loads
on first use, never on the event loop: :class:`PromptKeyer` sends such a request to a thread.

Cost: the Rust encoder is far slower than the gateway's vectorised one (the tiny test model's
1,024-token BPE: ~100 ms for a 200 KB prompt on this machine; large vocabularies merge less and
run faster). :meth:`EngineTokenizer.encode` goes through ``encode_batch``, which releases the GIL
while it runs (``encode`` holds it), and the front door keys bodies above
:data:`INLINE_BYTES` in a thread (:class:`PromptKeyer`), so the event loop and every stream on it
carry on meanwhile; bodies parsed in the worker process (``offload_parse_bytes``) are keyed there.
The request itself waits for its key: it is routed by it. The threads' queue is bounded
(:data:`MAX_WAITING`): past it a request is routed without a key rather than wait.

A Rust panic in the tokenizer (pyo3's ``PanicException``, a ``BaseException``) is caught like any
other error: the request is routed without a prefix match.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from gateway import metrics
from gateway.api.request_parse import truncation
from gateway.fleet.block_hash import U64Array
from gateway.fleet.prompt_key import MAX_PROMPT_CHARS, left_truncated, prompt_token_ids, responses_chat_body

log = logging.getLogger("slogate.fleet")

#: bodies up to this many bytes are keyed on the event loop (a thread hand-off costs more)
INLINE_BYTES = 2048
#: the named special tokens transformers hands a chat template as variables
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: template variables a body's ``chat_template_kwargs`` may not replace
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
INSTALL_HINT = "pip install 'slogate[hf-tokenizer]'"
#: threads keying large prompts: all cores but the event loop's, at most 4
_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
#: keying jobs that may wait for a thread (beyond the ones running): a new large request past it
#: is not keyed (routed by load, counted in ``slogate_prefix_keys_skipped_total``). A large
#: prompt takes ~60-100 ms to encode and there is one thread on a 2-core machine, so 4 waiting
#: already add up to ~0.5 s before the last one is routed; an unbounded queue under a burst of
#: long prompts would add without limit to every one's time to first token, while skipping the
#: key only costs that request its prefix match.
MAX_WAITING = 4
#: the template names :meth:`EngineTokenizer.render_chat` may use (compiled when it loads)
_USED_TEMPLATES = ("default", "tool_use")


class EngineTokenizerError(RuntimeError):
    """A configured engine tokenizer that cannot be loaded at start-up (a configuration error)."""


def is_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust panic crossing into Python (pyo3's
    ``pyo3_runtime.PanicException``): a ``BaseException``, so ``except Exception`` misses it, and
    it cannot be imported to be named."""
    return any(t.__name__ == "PanicException" and t.__module__ == "pyo3_runtime" for t in type(exc).__mro__)


def missing_packages() -> list[str]:
    """The packages an engine tokenizer needs that are not installed."""
    missing = []
    for name in ("tokenizers", "jinja2"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def directory_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be loaded as an engine tokenizer (None: it can be)."""
    if not (directory / "tokenizer.json").is_file():
        return f"{directory} has no tokenizer.json (a Hugging Face model or tokenizer directory)"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it: a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The model's chat templates by name (``default`` the plain one), as transformers loads
    them: ``chat_template.jinja`` wins over the config's ``chat_template`` (a string or a list
    of ``{name, template}``)."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                template = entry.get("template")
                if isinstance(template, str):
                    templates[str(entry["name"])] = template
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


def _compile(source: str) -> Any:
    """The template in transformers' environment (``_compile_jinja_template``)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _iterates_content(source: str) -> bool:
    """Whether the template loops over a message's content (vLLM's "openai" content format:
    text parts stay ``{"type": "text", "text": ...}`` dicts), found in its syntax tree the way
    vLLM's ``_detect_content_format`` does, without its macro and assignment tracking."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return False

    def base(node: nodes.Node) -> nodes.Node:
        while isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
            node = node.node
        return node

    message_vars = set()
    for loop in tree.find_all(nodes.For):
        it = base(loop.iter)
        if isinstance(it, nodes.Name) and it.name == "messages" and isinstance(loop.target, nodes.Name):
            message_vars.add(loop.target.name)
    for loop in tree.find_all(nodes.For):
        it = base(loop.iter)
        if isinstance(it, nodes.Name) and it.name == "content":
            return True
        item = isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"
        attr = isinstance(it, nodes.Getattr) and it.attr == "content"
        owner = getattr(it, "node", None)
        if (item or attr) and isinstance(owner, nodes.Name) and owner.name in message_vars:
            return True
    return False


@dataclass(frozen=True, slots=True)
class _ChatTemplate:
    """A chat template ready to render, published whole (never half-built to another thread)."""

    compiled: Any
    #: the template iterates over a message's content: text parts stay ``{"type": "text"}`` dicts
    openai_format: bool
    #: the template names the ``developer`` role (else a developer message becomes a system one)
    developer: bool

    @classmethod
    def build(cls, source: str) -> _ChatTemplate:
        developer = '"developer"' in source or "'developer'" in source
        return cls(_compile(source), _iterates_content(source), developer)


class Unkeyable(ValueError):
    """A prompt the engine tokenizer does not reproduce: the request is not keyed."""


class EngineTokenizer:
    """One model's tokenizer and chat template, loaded from a Hugging Face directory. Everything
    is loaded and compiled here (slow: a thread's work, see :func:`preload`) and never changes
    after, so any number of threads may key with it at once."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self._tokenizer = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        config = _read_json(self.directory / "tokenizer_config.json")
        self.special_tokens = {
            name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None
        }
        self.templates = _chat_templates(self.directory, config)
        #: the templates it renders, compiled (a syntax error fails the load, not a request)
        self._chat = {
            name: _ChatTemplate.build(self.templates[name])
            for name in _USED_TEMPLATES
            if name in self.templates
        }
        self._panic_logged = False

    # -- pieces ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> U64Array:
        """``text``'s token ids. ``encode_batch`` rather than ``encode``: it releases the GIL."""
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return np.array(encoding.ids, dtype=np.uint64)

    def _template(self, tools: object) -> _ChatTemplate:
        if tools is not None and "tool_use" in self._chat:
            return self._chat["tool_use"]
        if "default" in self._chat:
            return self._chat["default"]
        raise Unkeyable(f"{self.directory} has no chat template")

    def render_chat(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: object = None,
        documents: object = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat as the model's template renders it (raises :class:`Unkeyable` or the
        template's own error for what cannot be rendered)."""
        template = self._template(tools)
        conversation = [_message(m, template.openai_format, template.developer) for m in messages]
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
        rendered: str = template.compiled.render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **extra},
        )
        return rendered

    # -- a request's prompt ----------------------------------------------------------------------

    def chat_token_ids(self, body: Mapping[str, Any]) -> U64Array | None:
        """The chat's prompt ids as vLLM computes them (raises for what it cannot reproduce)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unkeyable("no messages")
        if body.get("chat_template") is not None or body.get("continue_final_message"):
            raise Unkeyable("a request's own chat template or a continued final message")
        add_generation_prompt = body.get("add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs")
        # (vLLM's chat default: the template carries the special tokens; true adds the
        # tokenizer's own, a BOS on top of the template's, as the engine then does)
        add_special = body.get("add_special_tokens", False)
        if (
            not isinstance(add_generation_prompt, bool)
            or not isinstance(kwargs, Mapping | None)
            or not isinstance(add_special, bool)
        ):
            raise Unkeyable("add_generation_prompt, add_special_tokens or chat_template_kwargs: wrong type")
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=body.get("tools"),
            documents=body.get("documents"),
            template_kwargs=kwargs,
        )
        return self._truncated(text, add_special, body)

    def completion_token_ids(self, body: Mapping[str, Any]) -> U64Array | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise Unkeyable("add_special_tokens must be a boolean")
            return self._truncated(prompt, add_special, body) if prompt else None
        if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt[:4]):
            return left_truncated(np.array(prompt, dtype=np.uint64), body)
        return None

    def _truncated(self, text: str, add_special: bool, body: Mapping[str, Any]) -> U64Array | None:
        """``text`` encoded as the engine keeps it under the body's ``truncate_prompt_tokens``.
        vLLM truncates inside the tokenizer call, the special tokens it adds (a BOS) counted in
        the k and kept: the last k tokens of the encoding are not that, so such a prompt is not
        keyed; nor is one keyed by its start only (past :data:`MAX_PROMPT_CHARS`)."""
        tokens = self.encode(text[:MAX_PROMPT_CHARS], add_special_tokens=add_special)
        if truncation(body) is None:
            return tokens
        if add_special and self.adds_special_tokens:
            raise Unkeyable("truncate_prompt_tokens with special tokens the tokenizer adds")
        return left_truncated(tokens, body, capped=len(text) > MAX_PROMPT_CHARS)

    @functools.cached_property
    def adds_special_tokens(self) -> bool:
        """Whether encoding with special tokens adds any (a BOS, an EOS) to a text's own."""
        return len(self.encode("a", add_special_tokens=True)) != len(
            self.encode("a", add_special_tokens=False)
        )

    def prompt_token_ids(self, kind: str, body: Mapping[str, Any]) -> U64Array | None:
        """Token ids of a chat or completions request's prompt as vLLM tokenizes it; None for
        other requests and for anything it cannot reproduce. Never raises (a Rust panic in the
        tokenizer included; KeyboardInterrupt, SystemExit and the like still do)."""
        try:
            if kind == "responses":
                chat = responses_chat_body(body)
                if chat is None:
                    return None
                kind, body = "chat", chat
            if kind == "chat":
                tokens: U64Array | None = self.chat_token_ids(body)
            elif kind == "completions":
                tokens = self.completion_token_ids(body)
            else:
                return None
        except Exception:  # a template's own error, a bad body: not keyed, never a failed request
            return None
        except BaseException as exc:
            if not is_panic(exc):
                raise
            if not self._panic_logged:  # once: a client could send the same input again and again
                self._panic_logged = True
                log.warning(
                    "engine tokenizer %s panicked (%s); the request is not keyed", self.directory, exc
                )
            return None
        return tokens if tokens is not None and len(tokens) else None


def _message(message: Any, openai_format: bool, developer: bool) -> dict[str, Any]:
    """One message as vLLM's chat parser hands it to the template (text only)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise Unkeyable("a message is an object with a string role")
    role = message["role"]
    if role == "developer" and not developer:
        role = "system"
    content = message.get("content")
    texts: list[str]
    if content is None:
        texts = []
    elif isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise Unkeyable("only text content parts are keyed")
    else:
        raise Unkeyable("content is a string or a list of parts")
    out: dict[str, Any] = {"role": role}
    out["content"] = [{"type": "text", "text": t} for t in texts] if openai_format else "\n".join(texts)
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    calls = message.get("tool_calls")
    if role == "assistant" and isinstance(calls, list) and calls:
        out["tool_calls"] = [_tool_call(c) for c in calls]
    return out


def _tool_call(call: Any) -> Any:
    """Tool-call arguments as a dict, as vLLM hands them to templates (a JSON string otherwise)."""
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


#: directory -> its tokenizer, or None when it could not be loaded (tried once per process)
_loaded: dict[str, EngineTokenizer | None] = {}
#: directory -> the lock one load of it holds (threads asking for the same directory wait for it)
_load_locks: dict[str, threading.Lock] = {}


def _load_strict(directory: str) -> EngineTokenizer:
    """The tokenizer in ``directory``, loaded and cached; raises what the load raised (a Rust
    panic included)."""
    with _load_locks.setdefault(directory, threading.Lock()):
        tokenizer = _loaded.get(directory)
        if tokenizer is None:
            tokenizer = EngineTokenizer(directory)
            _loaded[directory] = tokenizer
        return tokenizer


def load(directory: str) -> EngineTokenizer | None:
    """The tokenizer in ``directory``, loaded once per process (None, logged once, when it
    cannot be: the model's prompts are then not keyed). Slow the first time: not on the loop."""
    if directory in _loaded:
        return _loaded[directory]
    try:
        return _load_strict(directory)
    except BaseException as exc:
        if not isinstance(exc, Exception) and not is_panic(exc):
            raise
        _loaded.setdefault(directory, None)
        log.warning(
            "engine tokenizer %s cannot be loaded (%s); its model's prompts are not keyed", directory, exc
        )
        return None


def _preload_one(model: str, directory: str) -> None:
    try:
        _load_strict(directory)
    except BaseException as exc:
        if not isinstance(exc, Exception) and not is_panic(exc):
            raise
        raise EngineTokenizerError(
            f"engine_tokenizers.{model}: {directory} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc


async def preload(engine_tokenizers: Mapping[str, str | os.PathLike[str]]) -> None:
    """Load every configured tokenizer and compile its chat templates, each in a thread, so that
    no request loads one (on the event loop, a large vocabulary's load stalls every stream for
    hundreds of milliseconds). Raises :class:`EngineTokenizerError`, naming the model, for one
    that cannot be loaded: a configuration error, the gateway does not start with it."""
    await asyncio.gather(
        *(
            asyncio.to_thread(_preload_one, model, os.fspath(directory))
            for model, directory in engine_tokenizers.items()
        )
    )


def engine_prompt_token_ids(
    kind: str, body: Mapping[str, Any], model: str, engine_tokenizers: Mapping[str, str] | None
) -> U64Array | None:
    """The prompt's ids for the prefix index: with ``model``'s engine tokenizer when one is
    configured, else the gateway's own tokenizer (``prompt_key.prompt_token_ids``)."""
    directory = engine_tokenizers.get(model) if engine_tokenizers else None
    if directory is None:
        return prompt_token_ids(kind, body)
    tokenizer = load(directory)
    return None if tokenizer is None else tokenizer.prompt_token_ids(kind, body)


class PromptKeyer:
    """The front door's keying of prompts for the prefix index: each model's engine tokenizer
    where one is configured (in a thread for bodies above :data:`INLINE_BYTES` and for a
    tokenizer not loaded yet, at most :data:`MAX_WAITING` waiting), the gateway's tokenizer for
    the rest."""

    def __init__(self, engine_tokenizers: Mapping[str, str | os.PathLike[str]]) -> None:
        #: model -> tokenizer directory (strings: sent to the parsing worker as they are)
        self.directories = {model: os.fspath(path) for model, path in engine_tokenizers.items()}
        self._pool: ThreadPoolExecutor | None = None
        #: keying jobs handed to the threads and not finished (running or waiting)
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()

    def token_ids(self, kind: str, body: Mapping[str, Any], model: str) -> U64Array | None:
        return engine_prompt_token_ids(kind, body, model, self.directories)

    async def token_ids_async(
        self, kind: str, body: Mapping[str, Any], model: str, body_bytes: int
    ) -> U64Array | None:
        """:meth:`token_ids`, in a thread when the model has an engine tokenizer and the body is
        large or the tokenizer is not loaded yet (the encoder releases the GIL: the loop carries on
        while it runs; a load is never the loop's). None, at once, when :data:`MAX_WAITING` jobs
        already wait for a thread: the request is routed without a prefix match."""
        directory = self.directories.get(model)
        if directory is None:
            return prompt_token_ids(kind, body)
        if directory in _loaded:
            tokenizer = _loaded[directory]
            if tokenizer is None:  # it could not be loaded: the model's prompts are not keyed
                return None
            if body_bytes <= INLINE_BYTES:
                return tokenizer.prompt_token_ids(kind, body)
        with self._in_flight_lock:
            if self._in_flight >= _THREADS + MAX_WAITING:
                metrics.PREFIX_KEYS_SKIPPED.inc()
                return None
            self._in_flight += 1
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="engine-tokenizer")
            job = self._pool.submit(self.token_ids, kind, body, model)
        except BaseException as exc:
            self._finished(None)
            if isinstance(exc, RuntimeError):  # no new threads (the interpreter exiting): not keyed
                return None
            raise
        # counted out when the job ends or is cancelled before it starts (its request gone)
        job.add_done_callback(self._finished)
        return await asyncio.wrap_future(job)

    def _finished(self, _job: Future[U64Array | None] | None) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
