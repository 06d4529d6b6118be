"""The simulated engine's real-time HTTP driver: vLLM 0.33's wire protocol over :class:`EngineModel`.

One asyncio task (``_drive``) runs the model: plan a batch, sleep its duration divided by the
time scale, apply it, hand each request its tokens. Request handlers only parse, enqueue, and
stream what they are handed. Simulated time is real time multiplied by the time scale.

Extensions beyond vLLM (documented in docs/sim-engine.md): body ``sim_output_len`` / header
``X-Sim-Output-Len`` cap the output length; header ``X-Sim-Fault`` injects faults per request
(``crash-after=N``: the engine crashes after this request's N-th token; ``hang``: this request
never progresses; ``slow=F``: the engine runs F times slower); ``POST /sim/fault`` does the same
engine-wide; ``POST /sim/load_weights`` models weight loading; ``POST /sim/kv/pull`` is the
P->D KV side channel (the sim uses its HTTP address where vLLM uses NIXL's). The Responses API
(``/v1/responses``) is :mod:`gateway.sim.responses_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import generate_latest

from gateway.api.errors import described
from gateway.sim import embeddings as emb
from gateway.sim.admin import AdminRoutes
from gateway.sim.engine import EngineModel, Phase, SimRequest
from gateway.sim.kv_events import KVEventPublisher
from gateway.sim.lora import LoraAdapters
from gateway.sim.metrics import SimMetrics
from gateway.sim.output import sequence_state
from gateway.sim.profiles import EngineProfile
from gateway.sim.responses import (
    BadRequest,
    OutputState,
    ResponseFormat,
    batch_deltas,
    error_body,
    usage_of,
)
from gateway.sim.responses_routes import ResponsesRoutes
from gateway.sim.responses_store import DEFAULT_CAPACITY as DEFAULT_STORE_CAPACITY
from gateway.sim.validation import COMPLETION_MAX_TOKENS, validate
from gateway.sim.validation import messages as check_messages
from gateway.tokenizer import VOCAB_SIZE, apply_chat_template, decode, encode

_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
HELD_LEASE_S = 30.0
#: the most prompts one completions batch may hold (vLLM's VLLM_MAX_COMPLETION_PROMPTS default)
MAX_COMPLETION_PROMPTS = 1024
#: the longest natural output a workload may set (sim_output_len, X-Sim-Output-Len)
MAX_SIM_OUTPUT_LEN = (1 << 31) - 1
#: on stop, requests in progress may finish for this long before their connections are cut
DRAIN_S = 10.0


@dataclass(slots=True)
class Channel:
    """Tokens the driver handed a request and the handler has not written yet."""

    tokens: list[int] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    crashed: bool = False


@dataclass(slots=True)
class Choice:
    """One of the ``n`` choices of a request: its own engine request, channel and output."""

    index: int
    sim: SimRequest
    channel: Channel
    out: OutputState
    first_real: float | None = None
    last_real: float = 0.0
    started: bool = False  # streaming: its first chunk went out
    ended: bool = False  # streaming: its finish chunk went out


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: EngineProfile
    model: str
    engine_id: str = "0"
    role: str = "collocated"
    time_scale: float = 1.0
    scheduling_policy: str = "fcfs"
    host: str = "127.0.0.1"
    port: int = 0
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv"
    seed: int = 0
    #: False: a generation-only model; /v1/embeddings answers that it does not support the task
    embeddings: bool = True
    #: LoRA adapters loaded at start-up (``--lora-modules``), name -> path
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: the engine's true speed relative to its profile (``--speed``): 2 runs every step in half
    #: the profile's time. What a gateway that learns its engines must find out for itself.
    speed: float = 1.0
    #: the most Responses API responses kept (``--responses-store-size``); 0: none, as vLLM
    #: without VLLM_ENABLE_RESPONSES_API_STORE
    responses_store: int = DEFAULT_STORE_CAPACITY


def _parse_fault_header(header: str | None) -> list[tuple[str, float]]:
    """``X-Sim-Fault: crash-after=N, hang, slow=F`` as (name, value) pairs; a bad one is a 400."""
    faults: list[tuple[str, float]] = []
    for part in (header or "").split(","):
        name, _, text = part.strip().partition("=")
        if not name:
            continue
        if name == "hang":
            faults.append((name, 0.0))
            continue
        if name not in ("crash-after", "slow"):
            raise BadRequest(400, f"unknown X-Sim-Fault {part.strip()!r}; use crash-after=N, hang or slow=F")
        try:
            value = int(text) if name == "crash-after" else float(text)
        except ValueError:
            value = -1
        if not (0 <= value < math.inf if name == "crash-after" else 0 < value < math.inf):
            raise BadRequest(
                400, f"X-Sim-Fault {part.strip()!r}: crash-after takes an integer >= 0, slow a number > 0"
            )
        faults.append((name, float(value)))
    return faults


class SimServer:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.model = EngineModel(
            config.profile,
            priority_scheduling=config.scheduling_policy == "priority",
            seed=config.seed,
            slow_factor=1.0 / config.speed,
        )
        self.started_at = int(time.time())
        self.scale = config.time_scale
        self.channels: dict[str, Channel] = {}
        self.crashed = False
        self.hung = False
        self.admin = AdminRoutes(self)
        self.responses = ResponsesRoutes(self)
        self.loras = LoraAdapters(config.model, dict(config.lora_modules))
        self.url = ""
        self._wake = asyncio.Event()
        self._t0 = 0.0
        self._driver: asyncio.Task[None] | None = None
        self._crash_after: dict[str, int] = {}
        self.rooms: dict[str, asyncio.Event] = {}
        self._session: aiohttp.ClientSession | None = None
        self._publisher = (
            KVEventPublisher(config.kv_events_endpoint, config.kv_events_topic)
            if (config.kv_events_endpoint)
            else None
        )
        self._runner: web.AppRunner | None = None
        self.metrics_ = SimMetrics(self)
        self.h_ttft = self.metrics_.ttft
        self.h_itl = self.metrics_.itl
        self.h_e2e = self.metrics_.e2e
        # the model's own statistics report real seconds, as the HTTP-level histograms do
        self.model.stats.time_scale = self.scale

    # -- clock and driver ------------------------------------------------------------------------

    def now(self) -> float:
        """Simulated seconds since start."""
        return (time.monotonic() - self._t0) * self.scale

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        target = loop.time()
        last_lease_check = 0.0
        while True:
            if self.crashed or self.hung or not self.model.has_work:
                # (KV held for a decode engine that never reads it is freed when its lease ends,
                # busy or idle: an idle engine kept it, and its KV use, until other work came)
                lease = math.inf if self.crashed or self.hung else self._lease_ends_in()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), None if math.isinf(lease) else lease)
                self._wake.clear()
                self._expire_leases()
                target = loop.time()
                continue
            batch = self.model.plan(self.now())
            if batch is None:
                wait = min((self.model.next_transfer_at() - self.now()) / self.scale, self._lease_ends_in())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), None if math.isinf(wait) else max(wait, 0.0005))
                self._wake.clear()
                self._expire_leases()
                target = loop.time()
                continue
            # Steps are laid on an absolute timeline so sleep overshoot and the driver's own work
            # (finish + plan grow with the batch: ~35 ms per step at 1,024 streams) do not add to
            # the modelled step times. A lag longer than one step is forgotten rather than caught
            # up in a burst of instant steps.
            step = batch.duration / self.scale
            target = max(target, loop.time() - max(step, 0.02)) + step
            delay = target - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            if self.crashed:
                continue
            result = self.model.finish(batch, self.now())
            for request, token in result.tokens:
                channel = self.channels.get(request.request_id)
                if channel is not None:
                    channel.tokens.append(token)
                    channel.event.set()
                crash_at = self._crash_after.get(request.request_id)
                if crash_at is not None and len(request.output) >= crash_at:
                    self.crash()
            for request in result.finished:
                channel = self.channels.get(request.request_id)
                if channel is not None:
                    channel.done = True
                    channel.event.set()
            self.publish_kv_events()
            if loop.time() - last_lease_check > 1.0:
                last_lease_check = loop.time()
                self._expire_leases()

    def _lease_ends_in(self) -> float:
        """Real seconds until the first lease on held KV ends (inf when none is held)."""
        started = [r.first_token_at for r in self.model.held.values() if r.first_token_at is not None]
        if not started:
            return math.inf
        return max(0.0005, (min(started) + HELD_LEASE_S - self.now()) / self.scale + 0.001)

    def _expire_leases(self) -> None:
        if self.model.held and self.model.expire_held(self.now(), HELD_LEASE_S):
            self.publish_kv_events()

    def publish_kv_events(self) -> None:
        events = self.model.cache.drain_events()
        if events and self._publisher is not None:
            self._publisher.publish(events)

    def wake_driver(self) -> None:
        """Tell the driver loop that work (or a state change) arrived."""
        self._wake.set()

    def end_requests(self, requests: list[SimRequest], crashed: bool) -> None:
        """Wake the handlers of requests the model dropped: crashed streams are cut, others end
        normally with their finish_reason (e.g. "abort")."""
        for request in requests:
            channel = self.channels.get(request.request_id)
            if channel is not None:
                channel.crashed = crashed
                channel.done = True
                channel.event.set()

    def crash(self) -> None:
        """Engine death: every in-flight stream is cut, /health answers 503 until cleared."""
        self.crashed = True
        self.end_requests(self.model.reset(), crashed=True)
        self.publish_kv_events()

    # -- lifecycle -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/embeddings", self.embeddings)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        self.admin.register(app)
        self.responses.register(app)
        self.loras.register(app)
        return app

    async def start(self) -> str:
        self._t0 = time.monotonic()
        self._session = aiohttp.ClientSession()
        self._driver = asyncio.create_task(self._drive())
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=DRAIN_S
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=4096)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        # the listener closes first and what is running finishes (within DRAIN_S) while the
        # driver still steps: cancelled first, it froze every open stream until aiohttp's own
        # shutdown timeout (a minute) cut them
        if self._runner is not None:
            await self._runner.cleanup()
        await self.responses.close()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        if self._session is not None:
            await self._session.close()
        if self._publisher is not None:
            self._publisher.close()

    # -- OpenAI routes ---------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "embedding")

    def _prompts(self, kind: str, body: dict[str, Any]) -> list[list[int]]:
        """The request's prompts as token ids: one for a chat, a completions body's batch (a
        string, token ids, or a list of either) one per entry, as vLLM takes them."""
        if kind == "chat":
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise BadRequest(400, "'messages' must be a non-empty list of objects", "messages")
            try:
                return [encode(apply_chat_template(messages, tools=body.get("tools")))]
            except ValueError as exc:  # (tools or tool calls nested too deep to write)
                raise BadRequest(400, f"the chat cannot be rendered: {exc}", "messages") from None
        prompt = body.get("prompt")
        batch: list[Any]
        if isinstance(prompt, str) or _token_ids(prompt):
            batch = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
            batch = prompt
        else:
            raise BadRequest(
                400, "'prompt' must be a string, a list of token ids, or a non-empty list of those", "prompt"
            )
        if any(p == "" for p in batch):
            raise BadRequest(400, "the prompt cannot be empty", "prompt")
        if len(batch) > MAX_COMPLETION_PROMPTS:
            raise BadRequest(
                400,
                f"prompt list length {len(batch)} exceeds the maximum allowed count of "
                f"{MAX_COMPLETION_PROMPTS}",
                "prompt",
            )
        return [encode(p) if isinstance(p, str) else list(p) for p in batch]

    async def _generate(self, http: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = orjson.loads(await http.read())
            if not isinstance(body, dict):
                raise BadRequest(400, "request body must be a JSON object")
            if self.crashed:
                raise BadRequest(503, "engine is dead")
            if kind == "embedding":
                return await self._embed(http, body)
            return await self._run(http, kind, body)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON: {exc}")
        except BadRequest as exc:
            return _error(exc.status, str(exc), exc.param, exc.kind)
        except ConnectionAbortedError as exc:  # the engine died under a non-streamed request
            return _error(500, f"EngineDeadError: {exc}")

    def _limits(self, kind: str, body: dict[str, Any], prompt_len: int) -> int:
        """The request's output bound, as vLLM sets it: the client's ``max_tokens`` (a chat's
        ``max_completion_tokens`` first; a completion's default is 16, a chat's the room left),
        cut to what the context leaves after the prompt. Refused: a prompt that fills the
        context, a bound that is no integer >= 1 or longer than the whole context."""
        max_len = self.profile.max_model_len
        if prompt_len >= max_len:
            raise BadRequest(
                400,
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                "messages",
            )
        field = "max_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            field = "max_completion_tokens"
        limit = body.get(field)
        if limit is None and kind == "completion":
            limit = COMPLETION_MAX_TOKENS
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise BadRequest(400, f"{field} must be an integer >= 1", field)
        if limit is not None and limit > max_len:
            raise BadRequest(
                400,
                f"{field}={limit} cannot be greater than max_model_len={max_len}. "
                "Please request fewer output tokens.",
                field,
            )
        cache = self.model.cache
        if cache.blocks_needed(prompt_len + 1) > cache.num_blocks:
            # (vLLM refuses to start with a cache smaller than its context; this engine can be
            # given one, and such a prompt waited at the head of the queue for good, and all
            # behind it)
            raise BadRequest(
                400,
                f"the prompt's {prompt_len} tokens do not fit this engine's KV cache "
                f"({cache.num_blocks} blocks of {cache.block_size} tokens)",
                "messages",
            )
        room = max_len - prompt_len
        return room if limit is None else min(limit, room)

    @staticmethod
    def _output_len(http: web.Request, body: dict[str, Any]) -> int | None:
        """The workload-set natural length: body ``sim_output_len`` or header ``X-Sim-Output-Len``
        (the smaller if both); None when neither is given."""
        lengths: list[int] = []
        header = http.headers.get("X-Sim-Output-Len")
        for extra in (body.get("sim_output_len"), header):
            if extra is None:
                continue
            # a body's integer, or the header's digits (int() also took true and 1.7)
            if isinstance(extra, int) and not isinstance(extra, bool):
                value = extra
            elif (
                extra is header
                and header is not None
                and (digits := header.strip()).isdecimal()
                and digits.isascii()
            ):
                value = int(digits)  # (isdigit() alone took "²", which int() refuses: a 500)
            else:
                why = f"sim_output_len must be an integer, got {described(extra)}"
                raise BadRequest(400, why, "sim_output_len")
            if not 1 <= value <= MAX_SIM_OUTPUT_LEN:
                # (the upper bound: a gateway resuming the stream writes it into a JSON body again)
                why = f"sim_output_len must be between 1 and {MAX_SIM_OUTPUT_LEN}, got {value}"
                raise BadRequest(400, why, "sim_output_len")
            lengths.append(value)
        return min(lengths) if lengths else None

    def _priority(self, body: dict[str, Any]) -> int:
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise BadRequest(400, "priority must be an integer", "priority")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise BadRequest(
                400, "Got priority != 0 but the scheduling policy is not 'priority'.", "priority"
            )
        return priority

    @staticmethod
    def _request_ids(http: web.Request, body: dict[str, Any]) -> tuple[str, str]:
        """The client-visible id and the engine-unique request id built on it."""
        given = body.get("request_id")
        if given is not None and not isinstance(given, str):
            raise BadRequest(400, f"request_id must be a string, got {described(given)}", "request_id")
        # (a header's bytes that are not UTF-8 come as surrogates, which no JSON answer can carry:
        # vLLM reads headers as latin-1 and answers; so does this engine, with those bytes escaped)
        header = http.headers.get("X-Request-Id")
        if header:
            header = header.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        base_id = header or given or os.urandom(8).hex()
        return base_id, f"{base_id}-{os.urandom(4).hex()}"

    async def _run(self, http: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
        problem = validate(kind, body)
        if problem is not None:
            raise BadRequest(400, *problem)
        model = body.get("model")
        if model is not None and not self.loras.serves(model):
            raise BadRequest(404, f"The model `{model}` does not exist.", "model")
        prompts = self._prompts(kind, body)
        keep = body.get("truncate_prompt_tokens")
        if keep is not None:
            # left truncation, as vLLM: the last k tokens are what is prefilled and cached
            max_len = self.profile.max_model_len
            if keep > max_len:
                raise BadRequest(
                    400,
                    f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_len}). "
                    "Please request a smaller truncation size.",
                    "truncate_prompt_tokens",
                )
            keep = max_len if keep == -1 else keep
            prompts = [prompt[-keep:] if keep > 0 else prompt for prompt in prompts]
        max_tokens = [self._limits(kind, body, len(prompt)) for prompt in prompts]
        for prompt in prompts:  # (after the lengths, as vLLM)
            if not 0 <= min(prompt) <= max(prompt) < VOCAB_SIZE:
                raise BadRequest(400, f"token ids must be in [0, {VOCAB_SIZE}): out of vocabulary", "prompt")
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        if options and not stream:
            raise BadRequest(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        stops = body.get("stop") or ()
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        priority = self._priority(body)
        n = body.get("n") or 1
        base_id, rid = self._request_ids(http, body)
        params = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else None
        room = body.get("bootstrap_room")
        _check_handover(params, room, body)
        if n > 1 and (params is not None or room is not None):
            raise BadRequest(400, "n > 1 cannot be combined with KV transfer (P/D) in the sim", "n")
        if len(prompts) > 1 and (params is not None or room is not None):
            raise BadRequest(
                400, "a batch of prompts cannot be combined with KV transfer (P/D) in the sim", "prompt"
            )
        prefill_only = bool(params and params.get("do_remote_decode")) or (
            room is not None and self.config.role == "prefill"
        )
        output_len = None if prefill_only else self._output_len(http, body)
        arrival = self.now()
        # n > 1 fans out into n engine requests, as vLLM's parallel sampling does: each takes a
        # sequence slot, KV blocks and its own decode steps (the prompt is computed per choice);
        # a batch of prompts into n per prompt, choice p * n + i for sequence i of prompt p
        single = n == 1 and len(prompts) == 1
        states = [None] if single else [sequence_state(prompt, self.model.seed) for prompt in prompts]
        sims = [
            SimRequest(
                rid if single else f"{p * n + i}_{rid}",
                prompt,
                1 if prefill_only else limit,
                arrival,
                priority=priority,
                ignore_eos=bool(body.get("ignore_eos")),
                prefill_only=prefill_only,
                output_len=output_len,
                choice=i,
                prompt_state=state,
            )
            for p, (prompt, limit, state) in enumerate(zip(prompts, max_tokens, states, strict=True))
            for i in range(n)
        ]
        faults = _parse_fault_header(http.headers.get("X-Sim-Fault"))  # (refused before any KV moves)
        if params and params.get("do_remote_prefill"):
            await self._pull_kv(
                sims[0],
                f"http://{params.get('remote_host')}:{params.get('remote_port')}",
                {"request_id": params.get("remote_request_id")},
            )
        elif room is not None and self.config.role == "decode":
            await self._pull_kv(
                sims[0],
                f"http://{body.get('bootstrap_host')}:{body.get('bootstrap_port')}",
                {"room": str(room), "wait_s": 30},
            )
        for sim in sims:
            self._apply_faults(faults, sim)
        # (an answer names the adapter the request asked for, as vLLM's does)
        served = model if isinstance(model, str) else self.config.model
        fmt = ResponseFormat(kind, base_id, served, bool(body.get("return_token_ids")))
        event = asyncio.Event()  # one wake-up for all choices: the handler drains them together
        choices = [Choice(i, sim, Channel(event=event), OutputState(stops)) for i, sim in enumerate(sims)]
        for choice in choices:
            self.channels[choice.sim.request_id] = choice.channel
            self.model.add(choice.sim)
        self.wake_driver()
        include_usage = bool(options.get("include_usage"))
        # (vLLM: usage on every chunk when both are asked for)
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        try:
            if stream and single:
                c = choices[0]
                return await self._stream(http, c.sim, fmt, c.out, c.channel, include_usage, room, continuous)
            if stream:
                return await self._stream_choices(http, choices, fmt, include_usage)
            return await self._complete(choices, fmt, room)
        finally:
            for choice in choices:
                self.release(choice.sim)

    async def _embed(self, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """Each input is a prefill-only engine request (vLLM runs pooling the same way): it waits
        for a slot, pays its prefill in the batch, and the answer comes once all have run."""
        if not self.config.embeddings:
            raise BadRequest(400, f"The model `{self.config.model}` does not support Embeddings API", "model")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest(400, f"model must be a string, got {described(model)}", "model")
        if model is not None and not self.loras.serves(model):
            raise BadRequest(404, f"The model `{model}` does not exist.", "model")
        dim = self.profile.embedding_dim
        try:
            prompts = emb.parse_input(body.get("input"))
            encoding, dimensions = emb.parse_options(body, dim)
        except emb.EmbeddingInputError as exc:
            raise BadRequest(400, str(exc), exc.param) from None
        max_len = self.profile.max_model_len
        for i, tokens in enumerate(prompts):
            if len(tokens) > max_len:
                raise BadRequest(
                    400,
                    f"This model's maximum context length is {max_len} tokens. However, input[{i}] has "
                    f"{len(tokens)} tokens. Please reduce the length of the input.",
                    "input",
                )
        priority = self._priority(body)
        base_id, rid = self._request_ids(http, body)
        arrival = self.now()
        event = asyncio.Event()
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        sims = [
            SimRequest(request_id, tokens, 1, arrival, priority=priority, pooling=True)
            for request_id, tokens in zip(ids, prompts, strict=True)
        ]
        channels = [Channel(event=event) for _ in sims]
        for sim, channel in zip(sims, channels, strict=True):
            self.channels[sim.request_id] = channel
            self.model.add(sim)
        self.wake_driver()
        try:
            while not all(channel.done for channel in channels):
                await event.wait()
                event.clear()
                if any(channel.crashed for channel in channels):
                    raise ConnectionAbortedError("engine crashed")
        finally:
            for sim in sims:
                self.channels.pop(sim.request_id, None)
                if sim.phase is not Phase.FINISHED:
                    self.model.abort(sim.request_id)  # client went away: free the slot and its blocks
                    self.wake_driver()
        end_real = time.monotonic()
        for sim in sims:
            self._observe(sim, None, end_real, 0)
        vectors = [emb.vector(sim.prompt, dim, self.config.seed, dimensions) for sim in sims]
        prompt_tokens = sum(len(tokens) for tokens in prompts)
        data = emb.response_body(base_id, model or self.config.model, vectors, encoding, prompt_tokens)
        return web.Response(body=data, content_type="application/json")

    def admit(self, sim: SimRequest, fault_header: str | None) -> Channel:
        """Queue ``sim`` in the engine as a chat's request is queued, its ``X-Sim-Fault`` applied;
        the channel is where the driver hands it its tokens. :meth:`release` must follow."""
        self._apply_faults(_parse_fault_header(fault_header), sim)
        channel = Channel()
        self.channels[sim.request_id] = channel
        self.model.add(sim)
        self.wake_driver()
        return channel

    def release(self, sim: SimRequest) -> None:
        """Forget ``sim``'s channel; one still in the engine (its client went away) is aborted, so
        its sequence slot and KV blocks are freed."""
        self.channels.pop(sim.request_id, None)
        self._crash_after.pop(sim.request_id, None)
        if sim.phase is not Phase.FINISHED and sim.phase is not Phase.HELD:
            self.model.abort(sim.request_id)
            self.wake_driver()

    def _apply_faults(self, faults: list[tuple[str, float]], sim: SimRequest) -> None:
        for name, value in faults:
            if name == "crash-after":
                self._crash_after[sim.request_id] = int(value)
            elif name == "hang":
                sim.stuck = True
            else:  # slow: relative to the engine's own speed
                self.model.slow_factor = value / self.config.speed

    async def _pull_kv(self, sim: SimRequest, source: str, payload: dict[str, Any]) -> None:
        assert self._session is not None
        try:
            async with self._session.post(
                source + "/sim/kv/pull", json=payload, timeout=aiohttp.ClientTimeout(total=60)
            ) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BadRequest(503, f"KV transfer from {source} failed: {exc!r}") from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if resp.status != 200:
            raise BadRequest(400, f"KV transfer failed: {data if data is not None else raw[:200]!r}")
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            # (the source is whatever the request named: not necessarily a prefill engine of ours)
            raise BadRequest(502, f"KV transfer from {source}: not a KV answer: {raw[:200]!r}")
        sim.remote_kv = True
        # the KV shares this engine's ingress link with other transfers (serial FIFO)
        sim.kv_ready_at = self.model.reserve_link(tokens, self.now())

    async def _tokens(self, channel: Channel) -> list[int]:
        await channel.event.wait()
        channel.event.clear()
        tokens, channel.tokens = channel.tokens, []
        if channel.crashed:
            raise ConnectionAbortedError("engine crashed")
        return tokens

    def _observe(self, sim: SimRequest, first_real: float | None, end_real: float, n: int) -> None:
        arrival_real = self._t0 + sim.arrival / self.scale
        if first_real is not None:
            self.h_ttft.observe(first_real - arrival_real)
        self.h_e2e.observe(end_real - arrival_real)

    def _kv_params(self, sim: SimRequest) -> dict[str, Any] | None:
        if not sim.prefill_only:
            return None
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(sim.seq.blocks),
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": sim.request_id,
            "remote_host": host,
            "remote_port": int(port),
            "tp_size": 1,
        }

    def _held(self, sim: SimRequest, room: object) -> None:
        if room is not None and sim.prefill_only:
            key = f"room:{room}"
            request = self.model.held.pop(sim.request_id, sim)
            if key in self.model.held and self.model.held[key] is not request:
                # a room used again: the earlier prefill's KV is never pulled now (overwritten,
                # its blocks stayed allocated for good)
                self.model.release_held(key)
            self.model.held[key] = request
            waiting = self.rooms.get(key)  # (a pull waiting for the room made it, and removes it)
            if waiting is not None:
                waiting.set()

    async def _complete(self, choices: list[Choice], fmt: ResponseFormat, room: object) -> web.StreamResponse:
        event = choices[0].channel.event
        pending = list(choices)
        while pending:
            await event.wait()
            event.clear()
            for choice in pending:
                channel = choice.channel
                tokens, channel.tokens = channel.tokens, []
                if channel.crashed:
                    raise ConnectionAbortedError("engine crashed")
                if tokens and choice.first_real is None:
                    choice.first_real = time.monotonic()
                for token in tokens:
                    if choice.out.add(token):
                        self.model.complete(choice.sim, "stop")
                        channel.done = True
                        break
            pending = [c for c in pending if not c.channel.done]
        end_real = time.monotonic()
        for choice in choices:
            self._observe(choice.sim, choice.first_real, end_real, len(choice.out.token_ids))
        first = choices[0].sim
        self._held(first, room)
        outputs = [
            (c.out.delta(True), c.out.token_ids, c.sim.finish_reason or "length", c.out.stop_reason)
            for c in choices
        ]
        body = fmt.full(outputs, _usage(choices), [c.sim.prompt for c in choices], self._kv_params(first))
        return web.Response(body=body, content_type="application/json")

    async def _stream(
        self,
        http: web.Request,
        sim: SimRequest,
        fmt: ResponseFormat,
        out: OutputState,
        channel: Channel,
        include_usage: bool,
        room: object,
        continuous: bool = False,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE)
        await resp.prepare(http)
        first_sent = False
        first_real: float | None = None
        last = time.monotonic()
        try:
            while not channel.done:
                tokens = await self._tokens(channel)
                now = time.monotonic()
                if tokens:
                    if first_real is None:
                        first_real = now
                    else:
                        self.h_itl.observe(now - last)
                    last = now
                parts: list[bytes] = []
                for text, ids, stopped in batch_deltas(out, tokens, channel.done):
                    if stopped:
                        self.model.complete(sim, "stop")
                        channel.done = True
                    if text or ids or not first_sent:
                        so_far = (
                            usage_of(len(sim.prompt), len(out.token_ids), sim.cached_tokens)
                            if continuous
                            else None
                        )
                        parts.append(
                            fmt.chunk(
                                text,
                                ids,
                                None,
                                first=not first_sent,
                                prompt_token_ids=None if first_sent else sim.prompt,
                                usage=so_far,
                            )
                        )
                        first_sent = True
                if parts:
                    await resp.write(b"".join(parts))
        except ConnectionAbortedError:
            if http.transport is not None:
                http.transport.abort()  # a cut, not a clean end: the client must see the failure
            return resp
        except ConnectionResetError:
            return resp  # the client left: _run's cleanup aborts the request (no traceback to log)
        self._held(sim, room)
        rest = out.delta(True)  # (held back for a stop string, when no token came after it)
        tail = fmt.chunk(rest, [], None) if rest else b""
        tail += fmt.final_chunk_with_params(
            sim.finish_reason or "length", self._kv_params(sim), out.stop_reason
        )
        if include_usage:
            tail += fmt.usage_chunk(usage_of(len(sim.prompt), len(out.token_ids), sim.cached_tokens))
        await resp.write(tail + b"data: [DONE]\n\n")
        self._observe(sim, first_real, time.monotonic(), len(out.token_ids))
        await resp.write_eof()
        return resp

    async def _stream_choices(
        self, http: web.Request, choices: list[Choice], fmt: ResponseFormat, include_usage: bool
    ) -> web.StreamResponse:
        """Streaming for n > 1 or a batch of prompts: each chunk carries one choice; a choice's
        finish chunk goes out when it ends. Kept apart from :meth:`_stream` so the n = 1 hot path
        pays nothing for it."""
        resp = web.StreamResponse(headers=_SSE)
        await resp.prepare(http)
        event = choices[0].channel.event
        live = list(choices)
        formats = [fmt.for_choice(c.index) for c in choices]
        try:
            while live:
                await event.wait()
                event.clear()
                now = time.monotonic()
                parts: list[bytes] = []
                for c in live:
                    tokens, c.channel.tokens = c.channel.tokens, []
                    if c.channel.crashed:
                        raise ConnectionAbortedError("engine crashed")
                    if tokens:
                        if c.first_real is None:
                            c.first_real = now
                        else:
                            self.h_itl.observe(now - c.last_real)
                        c.last_real = now
                    for text, ids, stopped in batch_deltas(c.out, tokens, c.channel.done):
                        if stopped:
                            self.model.complete(c.sim, "stop")
                            c.channel.done = True
                        if text or ids or not c.started:
                            prompt_ids = None if c.started else c.sim.prompt
                            parts.append(formats[c.index].chunk(text, ids, None, not c.started, prompt_ids))
                            c.started = True
                    if c.channel.done:
                        reason = c.sim.finish_reason or "length"
                        if rest := c.out.delta(True):  # (held back, when no token came after it)
                            parts.append(formats[c.index].chunk(rest, [], None, not c.started))
                            c.started = True
                        parts.append(
                            formats[c.index].final_chunk_with_params(reason, None, c.out.stop_reason)
                        )
                        c.ended = True
                        self._observe(c.sim, c.first_real, now, len(c.out.token_ids))
                live = [c for c in live if not c.ended]
                if parts:
                    await resp.write(b"".join(parts))
        except ConnectionAbortedError:
            if http.transport is not None:
                http.transport.abort()  # a cut, not a clean end: the client must see the failure
            return resp
        except ConnectionResetError:
            return resp  # the client left: _run's cleanup aborts the requests
        tail = b""
        if include_usage:
            tail = fmt.usage_chunk(_usage(choices))
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- other routes ----------------------------------------------------------------------------

    async def models(self, _: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": self.started_at,
                        "owned_by": "vllm",
                        "root": self.config.model,
                        "parent": None,
                        "max_model_len": self.profile.max_model_len,
                        "permission": [],
                    },
                    *self.loras.cards(self.started_at),
                ],
            }
        )

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=503 if self.crashed else 200)

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics_.registry), content_type="text/plain", charset="utf-8"
        )

    async def tokenize(self, http: web.Request) -> web.Response:
        try:
            body = orjson.loads(await http.read())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        messages = body.get("messages")
        if isinstance(messages, list):
            problem = check_messages("messages", messages)  # (as the chat route checks them)
            if problem is not None:
                return _error(400, problem, "messages")
            try:
                tokens = encode(apply_chat_template(messages, tools=body.get("tools")))
            except ValueError as exc:
                return _error(400, f"the chat cannot be rendered: {exc}", "messages")
        elif isinstance(body.get("prompt"), str):
            tokens = encode(body["prompt"])
        else:
            return _error(400, "give 'prompt' (string) or 'messages'", "prompt")
        return _json({"count": len(tokens), "max_model_len": self.profile.max_model_len, "tokens": tokens})

    async def detokenize(self, http: web.Request) -> web.Response:
        try:
            body = orjson.loads(await http.read())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON: {exc}")
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB_SIZE for t in tokens
        ):
            return _error(400, f"'tokens' must be a list of token ids in [0, {VOCAB_SIZE})", "tokens")
        return _json({"prompt": decode(tokens)})


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _error(status: int, message: str, param: str | None = None, kind: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, param, kind), content_type="application/json"
    )


def _token_ids(prompt: object) -> bool:
    """Whether ``prompt`` is one prompt given as token ids (a non-empty list of ints)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """A request's usage: each prompt counted once (its first sequence stands for the n that
    share it), every choice's output."""
    prompts = [c.sim for c in choices if c.sim.choice == 0]
    return usage_of(
        sum(len(sim.prompt) for sim in prompts),
        sum(len(c.out.token_ids) for c in choices),
        sum(sim.cached_tokens for sim in prompts),
    )


def _check_handover(params: dict[str, Any] | None, room: object, body: dict[str, Any]) -> None:
    """A 400 for handover fields of the wrong type (a value nested 1,000 deep, written into the
    pull's URL or body, raised past every handler: a 500, after the request had run)."""
    # (a room as its digits too: SGLang's model reads "123" as 123)
    fields: list[tuple[str, object, type | tuple[type, ...]]] = [("bootstrap_room", room, (int, str))]
    if params is not None:
        fields += [
            ("kv_transfer_params.remote_host", params.get("remote_host"), str),
            ("kv_transfer_params.remote_port", params.get("remote_port"), (int, str)),
            ("kv_transfer_params.remote_request_id", params.get("remote_request_id"), str),
        ]
    if room is not None:
        fields += [
            ("bootstrap_host", body.get("bootstrap_host"), str),
            ("bootstrap_port", body.get("bootstrap_port"), (int, str)),
        ]
    for name, value, kinds in fields:
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise BadRequest(400, f"{name} has the wrong type: {described(value)}", name.split(".")[0])
