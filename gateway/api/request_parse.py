"""Parse and validate only what routing needs; everything else passes through untouched.

The hot path parses the body once with orjson. Validation is limited to the fields the gateway
acts on (model, messages/prompt/input, stream, token limits, priority); anything the engine
understands and the gateway does not is the engine's business.

Nothing after the parse walks the prompt text: the prompt-token count routing uses is
:func:`gateway.tokenizer.estimate_total_tokens` over all of a request's texts at once, exact for
a few KB and sampled above, so a 15 MB prompt costs what a 5 KB one does (an exact count of it
held the event loop, and every stream on it, for ~1 s). What remains proportional to the body is
orjson's parse (~1 ms per MB of text) and, for bodies of many small items, one cheap pass over the
messages or token ids (C-level where it can be).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.api.errors import GatewayError, bad_request, described
from gateway.tokenizer import estimate_tokens, estimate_total_tokens
from policies.migration import batched_prompts, more_than_one

RouteKind = Literal["chat", "completions", "embeddings", "responses"]
#: a completion's output bound when its body gives none (the OpenAI API's default, and vLLM's)
COMPLETION_DEFAULT_MAX_TOKENS = 16

#: the longest message role taken (the roles templates know are words: user, assistant, tool...)
MAX_ROLE_CHARS = 64
#: per-message framing tokens of a ChatML-style template (role header and end marker)
_MESSAGE_OVERHEAD_TOKENS = 4
#: arrays longer than this have their element types checked on an even sample of this many
#: (a 2.5M token-id prompt took 140 ms to check element by element; the engine validates ids)
_TYPE_CHECK_LIMIT = 4096
_INT: frozenset[type] = frozenset((int,))  # type(), not isinstance(): bool is not a token id
_STR: frozenset[type] = frozenset((str,))
_LIST: frozenset[type] = frozenset((list,))


@dataclass(slots=True)
class ParsedRequest:
    kind: RouteKind
    raw: bytes
    #: the decoded body, or None until :attr:`body` is first read (a large body is parsed in a
    #: worker process, which sends back only the routing fields)
    parsed: dict[str, Any] | None
    #: the served model the request is routed by: the body's ``model``, or the base model of the
    #: LoRA adapter it names (see ``lora``)
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    #: estimated for routing (exact up to a few KB of text, within a few % above); the engine's
    #: usage reports the true count
    prompt_tokens: int
    #: the body's ``priority`` (0 the most urgent level), None when it has none
    priority: int | None
    #: ``body`` was changed for an engine since it was parsed: ``raw`` no longer says the same
    body_edited: bool = False
    #: the body's top-level member names (known without decoding a body parsed elsewhere)
    keys: frozenset[str] = frozenset()
    #: the body's ``user`` and ``cache_salt`` when they are strings (session key, prefix root)
    user: str | None = None
    cache_salt: str | None = None
    #: the prompt's token ids as the engine tokenizes it, when a parsing worker computed them
    #: (``gateway/fleet/prompt_key.py``; a uint64 array), else None
    prompt_ids: Any = None
    #: the LoRA adapter the body's ``model`` names, once the front door resolved it to the
    #: adapter's base model (then in ``model``; the body still names the adapter, as the engine
    #: needs), else None
    lora: str | None = None
    #: completions: the prompts in the body's batch (each its own choice); 1 otherwise
    prompts: int = 1
    #: the body's ``n`` (sequences per prompt), 1 when absent or not a count above 1
    n: int = 1
    #: chat: a message has a part other than text (an image, audio, a file)
    media: bool = False
    #: responses: the body's ``previous_response_id`` (the conversation it continues, which only
    #: the engine that stored that response has)
    previous_response: str | None = None
    #: responses: whether the engine keeps the answer (the body's ``store``, true by default), so
    #: that a later request may continue from it
    store: bool = True

    @property
    def body(self) -> dict[str, Any]:
        """The decoded body (decoded here on first use when it was parsed elsewhere)."""
        if self.parsed is None:
            self.parsed = orjson.loads(self.raw)
        return self.parsed

    @property
    def choices(self) -> int:
        """Choices the answer carries: ``n`` for each prompt (a completions batch has several).
        A stream sends an event per choice at each engine step, until that choice ends."""
        return self.n * max(1, self.prompts)

    def summary(self) -> ParsedRequest:
        """This request without its bytes and decoded body: what a parsing worker sends back."""
        return ParsedRequest(
            self.kind,
            b"",
            None,
            self.model,
            self.stream,
            self.client_wants_usage,
            self.max_tokens,
            self.prompt_tokens,
            self.priority,
            keys=frozenset(self.body),
            user=self.user,
            cache_salt=self.cache_salt,
            prompts=self.prompts,
            n=self.n,
            media=self.media,
            previous_response=self.previous_response,
            store=self.store,
        )


def parse_summary(
    kind: RouteKind,
    raw: bytes,
    default_max_tokens: int,
    prompt_ids: bool = False,
    engine_tokenizers: Mapping[str, str] | None = None,
) -> ParsedRequest:
    """:func:`parse_request` for a worker process: the routing fields only (cheap to send back),
    and with ``prompt_ids`` the prompt's token ids for the prefix index (computed here, off the
    event loop; with the model's tokenizer when ``engine_tokenizers`` names a directory for it)."""
    request = parse_request(kind, raw, default_max_tokens)
    summary = request.summary()
    if prompt_ids:
        from gateway.fleet.engine_tokenizer import engine_prompt_token_ids

        summary.prompt_ids = engine_prompt_token_ids(kind, request.body, request.model, engine_tokenizers)
    return summary


def truncation(body: Mapping[str, Any]) -> int | None:
    """The body's ``truncate_prompt_tokens`` when it asks the engine to keep only each prompt's
    last k >= 1 tokens (vLLM's left truncation; a whole float counts, as the engine's JSON model
    reads it), else None: absent, -1 for the model's own limit (which the gateway does not know),
    or not a count (the engine judges that)."""
    k = body.get("truncate_prompt_tokens")
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    return k if type(k) is int and k >= 1 else None


def _text_field(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    return value if isinstance(value, str) and value else None


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{key}' must be an integer >= 1, got {described(value)}", key)
    return value


def _only(values: Any, kinds: frozenset[type]) -> bool:
    """Whether ``values`` is an array every element of which has one of these exact types; on a
    long array an even sample of :data:`_TYPE_CHECK_LIMIT` elements and the last one stand for
    the rest."""
    if type(values) is not list:
        return False  # (slicing an object asks it for a key: KeyError, where slices hash)
    if len(values) > _TYPE_CHECK_LIMIT:
        values = [*values[:: len(values) // _TYPE_CHECK_LIMIT + 1], values[-1]]
    return set(map(type, values)) <= kinds


def _chat_prompt_tokens(body: dict[str, Any]) -> tuple[int, bool]:
    """The prompt's estimated tokens, and whether any message has a part other than text (an
    image, audio, a file)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of message objects", "messages")
    texts: list[str] = []
    media = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(role := message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        if len(role) > MAX_ROLE_CHARS:
            # (a role is a word; a long one was counted as none of the prompt's tokens, and keyed
            # token by token on the event loop)
            raise bad_request(
                f"messages[{i}].role must be at most {MAX_ROLE_CHARS} characters", f"messages[{i}].role"
            )
        media = _add_content(message.get("content"), texts, _CHAT_TEXT_PARTS) or media
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            texts.append(_rendered(calls))  # (an assistant turn's calls: the template writes them)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        # the template writes every tool's schema into the prompt: an agent's tools are often
        # thousands of tokens, and counted as none its prefill was predicted far too short
        texts.append(_rendered(tools))
    return chat_prompt_estimate(len(messages), estimate_total_tokens(texts)), media


#: chat content parts that are text (no type at all is text too)
_CHAT_TEXT_PARTS: frozenset[str | None] = frozenset(("text", None))


def _add_content(content: Any, texts: list[str], text_parts: frozenset[str | None]) -> bool:
    """Add a message's text (a string, or its text parts) to ``texts``; True when it has a part
    other than text. A part is text by its type, not by having a "text": an image part carrying
    one is still an image, and a prompt with one is not to be resent as text."""
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        text = [
            p["text"]
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str) and p.get("type") in text_parts
        ]
        texts.extend(text)
        return len(text) < len(content)
    return False


def _rendered(value: list[Any]) -> str:
    """``value`` as JSON text, about as a chat template renders it into the prompt (a value
    nested too deep to write is counted as nothing: the engine refuses such a body)."""
    try:
        return orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        return ""


def chat_prompt_estimate(messages: int, content_tokens: int) -> int:
    """The gateway's prompt-token estimate of a chat request: its contents plus what the chat
    template adds per message and for the assistant's turn (the offline simulator uses it too)."""
    return _MESSAGE_OVERHEAD_TOKENS * messages + 1 + content_tokens


#: Responses API input parts that are text (a part of another type is an image or a file)
_TEXT_PARTS: frozenset[str | None] = frozenset(
    ("input_text", "output_text", "text", "summary_text", "reasoning_text")
)
#: the longest ``previous_response_id`` taken (engines make ids of a few dozen characters)
MAX_RESPONSE_ID_CHARS = 256
#: what a response id may be: engines make ``resp_`` and hex digits. It goes into engine URLs
#: (a read of the response): no character a path, query or fragment could be made of
RESPONSE_ID = re.compile(rf"[A-Za-z0-9_:-]{{1,{MAX_RESPONSE_ID_CHARS}}}")


def _responses_prompt_tokens(body: dict[str, Any]) -> tuple[int, bool]:
    """A Responses API request's estimated prompt tokens (its instructions, input items and
    tools, rendered by the chat template as chat messages are), and whether an input part is
    other than text. What a ``previous_response_id`` adds is not in the body: the caller adds
    what it knows of that response."""
    texts: list[str] = []
    items = 0
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        texts.append(instructions)
        items += 1
    value = body.get("input")
    media = False
    if isinstance(value, str):
        texts.append(value)
        items += 1
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise bad_request(
                    f"input[{i}] must be an object (a message or another input item)", f"input[{i}]"
                )
            items += 1
            media = _add_content(item.get("content"), texts, _TEXT_PARTS) or media
            # a tool call and its output are written into the prompt as the template renders them
            for key in ("arguments", "output"):
                if isinstance(item.get(key), str):
                    texts.append(item[key])
    else:
        raise bad_request("'input' must be a string or an array of input items", "input")
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        texts.append(_rendered(tools))
    return chat_prompt_estimate(items, estimate_total_tokens(texts)), media


def _previous_response(body: dict[str, Any]) -> str | None:
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or RESPONSE_ID.fullmatch(value) is None:
        raise bad_request(
            f"'previous_response_id' must be a response id (1 to {MAX_RESPONSE_ID_CHARS} letters, "
            f"digits, '_', '-' or ':'), got {described(value)}",
            "previous_response_id",
        )
    return value


def _completion_prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        try:
            if _only(prompt, _INT):
                return len(prompt)
            if _only(prompt, _STR):
                return estimate_total_tokens(prompt)
            if _only(prompt, _LIST) and all(_only(p, _INT) for p in prompt):
                return sum(map(len, prompt))
        except (TypeError, AttributeError):
            # a long array's type check samples it: an element it did not look at is of another
            # type (the count read it as the sampled one). As malformed as one it saw.
            pass
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of those",
        "prompt",
    )


def _embedding_input_tokens(body: dict[str, Any]) -> int:
    value = body.get("input")
    if isinstance(value, str):
        return estimate_tokens(value)
    if isinstance(value, list) and value:
        if _only(value, _INT):
            return len(value)
        texts: list[str] = []
        other = 0  # token-id arrays count their length, anything else one token
        for v in value:
            if isinstance(v, str):
                texts.append(v)
            else:
                other += len(v) if isinstance(v, list) else 1
        return other + estimate_total_tokens(texts)
    raise bad_request("'input' must be a string or a non-empty array", "input")


def _count(value: Any) -> int:
    """A count field as an engine reads it (2.0 is 2, see :func:`policies.migration.more_than_one`);
    1 when it asks for no more than one (the engine refuses what is not a count at all)."""
    if not more_than_one(value):
        return 1
    try:
        return int(value)
    except (OverflowError, ValueError):  # (inf, nan: the engine refuses them)
        return 1


def parse_request(kind: RouteKind, raw: bytes, default_max_tokens: int) -> ParsedRequest:
    """Validate the routing-relevant fields of an OpenAI request body; raise a 400 on bad input."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    stream = body.get("stream")
    if stream is None:
        stream = False  # (null is the default, as vLLM reads it)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        for flag in ("include_usage", "continuous_usage_stats"):
            # (read loosely, "false" was true here and false at vLLM: no usage came either way)
            if options.get(flag) is not None and not isinstance(options[flag], bool):
                raise bad_request(f"'stream_options.{flag}' must be a boolean", "stream_options")
    # (absent is None, not vLLM's default 0: a body's 0 is a claim like x-priority: 0)
    priority = body.get("priority") if "priority" in body else None
    if "priority" in body and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise bad_request("'priority' must be an integer", "priority")

    if kind == "embeddings":
        return ParsedRequest(kind, raw, body, model, False, False, 0, _embedding_input_tokens(body), priority)
    if kind == "responses":
        return _responses_request(raw, body, model, stream, priority, default_max_tokens)
    media = False
    if kind == "chat":
        prompt_tokens, media = _chat_prompt_tokens(body)
    else:
        prompt_tokens = _completion_prompt_tokens(body)
    prompts = batched_prompts(body.get("prompt")) if kind == "completions" else 1
    keep = truncation(body)
    if keep is not None:
        # the engine keeps only each prompt's last ``keep`` tokens: that is what it prefills
        # (exact for a batch of token-id lists, whose lengths are known; a bound otherwise)
        prompt = body.get("prompt")
        if kind == "completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt_tokens = sum(min(len(p), keep) for p in prompt)
        else:
            prompt_tokens = min(prompt_tokens, keep * max(1, prompts))
    if (
        kind == "completions"
        and body.get("echo") is True
        and type(body.get("max_tokens")) is int
        and body["max_tokens"] == 0
    ):
        # scoring a prompt (its logprobs echoed, nothing generated), which vLLM and the legacy
        # API accept; planned as one token (what its prefill costs is the whole of it)
        max_tokens: int | None = 1
    else:
        max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    if max_tokens is None and kind == "completions":
        # a completion without a bound gets the API's default, not the gateway's (placement,
        # KV reservations and migration planned 1024 tokens for an answer stopped at 16)
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    wants_usage = bool(options and options.get("include_usage"))
    return ParsedRequest(
        kind,
        raw,
        body,
        model,
        stream,
        wants_usage,
        max_tokens or default_max_tokens,
        prompt_tokens,
        priority,
        user=_text_field(body, "user"),
        cache_salt=_text_field(body, "cache_salt"),
        prompts=prompts,
        n=_count(body.get("n")),
        media=media,
    )


def _responses_request(
    raw: bytes, body: dict[str, Any], model: str, stream: bool, priority: int | None, default_max_tokens: int
) -> ParsedRequest:
    prompt_tokens, media = _responses_prompt_tokens(body)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("'store' must be a boolean", "store")
    if body.get("background") not in (None, False):
        # (answered at once, it would run on its engine unseen by the gateway's placement, its
        # queue and its SLO accounting; any value but false, which an engine may read as true)
        raise bad_request("background responses are not supported by this gateway", "background")
    if body.get("request_id") is not None:
        # (an engine names the response by it: a client choosing it could take another's id)
        raise bad_request("'request_id' is chosen by the engine behind this gateway", "request_id")
    return ParsedRequest(
        "responses",
        raw,
        body,
        model,
        stream,
        # (the final event always carries the usage: nothing to ask for, nothing to drop)
        True,
        _positive_int(body, "max_output_tokens") or default_max_tokens,
        prompt_tokens,
        priority,
        user=_text_field(body, "user"),
        cache_salt=_text_field(body, "cache_salt"),
        media=media,
        previous_response=_previous_response(body),
        store=store is not False,
    )
