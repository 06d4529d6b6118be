"""The engine adapter seam: one typed base class, one subclass per engine kind.

An adapter knows how to talk to one engine: where its OpenAI routes are, how its ``/metrics``
map onto :class:`EngineState`, how to check its health, what it accepts in a request (the body
``priority``, forwarded headers). Lifecycle hooks (sleep, wake, weight loading, role changes)
come with the scaling and P/D flows that call them. All upstream HTTP goes through one shared
aiohttp session with an explicit connection pool, owned by the gateway and passed in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp
import orjson

from gateway.engines import prom_text
from gateway.open_files import out_of_sockets
from gateway.settings import EngineConfig
from policies.api import EngineState, Role

#: engine ``priority`` values stay integers that every JSON parser reads exactly
MAX_PRIORITY = (1 << 53) - 1
#: engine priorities are deadlines in milliseconds since this instant on the wall clock
#: (2026-01-01T00:00:00Z): every gateway replica sending to one engine counts from it
PRIORITY_EPOCH_S = 1_767_225_600.0
#: added to a late request's deadline (ms): later than any on-time deadline for ~11 days
LATE_URGENCY_MS = 1_000_000_000
#: the most a control answer (health, metrics, model list, slots) may hold: vLLM's metrics with
#: per-adapter histograms are a few hundred KB. Beyond, the read fails (a broken or hostile
#: engine streaming without end would hold the gateway's memory for the whole scrape timeout)
MAX_CONTROL_BODY = 16 << 20
#: ...and a metrics page: it is parsed on the event loop every scrape interval (5 to 40 ms a MB
#: here, by how short its lines are; vLLM's is 50-200 KB), so one past this fails the scrape (the
#: engine's state goes stale) rather than stall every stream for most of a second, every second
MAX_METRICS_BODY = 2 << 20


class ControlBodyTooLarge(aiohttp.ClientPayloadError):
    """A control answer past :data:`MAX_CONTROL_BODY`."""


async def read_control(resp: aiohttp.ClientResponse, limit: int = MAX_CONTROL_BODY) -> bytes:
    """A control answer's body, at most ``limit`` bytes (else :class:`ControlBodyTooLarge`)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ControlBodyTooLarge(f"answer of {resp.content_length} bytes, over {limit}")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise ControlBodyTooLarge(f"answer over {limit} bytes")
    return bytes(body)


async def read_up_to(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of an answer, and whether that was all of it (what is left is not
    read: the connection is closed with the response, not reused)."""
    if resp.content_length is not None and resp.content_length <= limit:
        return await resp.read(), True
    body = bytearray()
    while len(body) <= limit:
        chunk = await resp.content.read(1 << 16)
        if not chunk:
            return bytes(body), True
        body += chunk
    return bytes(body[:limit]), False


def json_object(raw: bytes) -> dict[str, Any] | None:
    """``raw`` decoded when it is a JSON object; None for anything else (not JSON, an array...)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def control_json(body: bytes) -> Any:
    """A control answer's JSON (ValueError when it is none)."""
    return orjson.loads(body)


class EngineAdapter:
    """Base adapter. Subclasses set ``kind`` and override :meth:`parse_metrics` and hooks."""

    kind: ClassVar[str] = "openai"
    #: whether the engine's scheduler understands the body field ``priority``
    supports_priority_field: ClassVar[bool] = False
    #: the kind's default direction: does its scheduler run lower ``priority`` values first?
    priority_low_first_default: ClassVar[bool] = True
    #: path of the Prometheus endpoint, or None when the engine publishes none
    metrics_path: ClassVar[str | None] = "/metrics"
    health_path: ClassVar[str] = "/health"
    #: the OpenAI model list, read for the LoRA adapters loaded (None: the engine has none)
    models_path: ClassVar[str | None] = "/v1/models"
    #: whether the engine understands the client's ``x-sim-*`` controls (the simulated engine)
    accepts_sim_headers: ClassVar[bool] = False
    #: whether the engine refuses a request for a model name its model list does not hold (vLLM
    #: answers 404): such an engine listing names without the configured model serves none of
    #: its requests (an address reused by another deployment). Servers that answer whatever the
    #: body names (llama.cpp, generic upstreams) are not judged by their list
    lists_served_model: ClassVar[bool] = False
    #: whether the block size its metrics report is the one its KV events hash blocks by (vLLM's
    #: cache config); SGLang reports token granularity for capacity whatever its page size, and
    #: its events' own size must decide, or every event of a paged cache is refused
    scraped_block_size_keys_events: ClassVar[bool] = True

    def __init__(
        self,
        config: EngineConfig,
        session: aiohttp.ClientSession,
        health_timeout_s: float,
        *,
        scrape_timeout_s: float | None = None,
        forward_sim_headers: bool = False,
    ) -> None:
        self.config = config
        self.session = session
        self.engine_id = config.engine_id
        self.base_url = config.base_url
        self.role: Role = config.role
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        # A busy engine answers /metrics slowly (a real vLLM took 2.3 s under load); scrapes get
        # their own, usually longer, budget so a slow one is a stale reading, not a dead engine.
        self._scrape_timeout = aiohttp.ClientTimeout(total=scrape_timeout_s or health_timeout_s)
        #: x-sim-* reach this engine only if it is simulated and the gateway was told to relay them
        self.forwards_sim_headers = self.accepts_sim_headers and forward_sim_headers
        #: when (monotonic) a connection to the engine was last refused: nothing listened at its
        #: address, so its process may have ended (and what comes from it next, a new one)
        self.refused_at = 0.0
        self._auth: dict[str, str] = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    @property
    def accepts_priority(self) -> bool:
        return self.supports_priority_field and self.config.priority_scheduling

    def deadline_priority(self, deadline_s: float, late: bool = False) -> int:
        """The body ``priority`` for a request due at ``deadline_s`` (its TTFT deadline, seconds
        since :data:`PRIORITY_EPOCH_S`, or on the offline simulator's clock) that makes the engine
        run the earliest deadline first, and a ``late`` request (its TTFT lost when dispatched)
        after every on-time one: the order the dispatcher planned, in which the late lane comes
        last. Kept an integer every JSON parser reads exactly."""
        urgency = int(deadline_s * 1000) + (LATE_URGENCY_MS if late else 0)
        return self.engine_priority(max(-MAX_PRIORITY, min(MAX_PRIORITY, urgency)))

    def engine_priority(self, urgency: int) -> int:
        """The body ``priority`` that makes this engine run ``urgency`` (lower = sooner) in order."""
        low_first = self.config.priority_low_first
        if low_first is None:
            low_first = self.priority_low_first_default
        return urgency if low_first else -urgency

    # -- data path -------------------------------------------------------------------------------

    def url(self, path: str) -> str:
        return self.base_url + path

    def upstream_headers(self, request_id: str, passthrough: dict[str, str] | None = None) -> dict[str, str]:
        """Headers for a data-path request; the body is sent as the client's JSON bytes.

        ``passthrough`` carries the client headers the gateway forwards (trace context, and the
        simulated engine's ``x-sim-*`` controls); the client's own Authorization never goes up.
        """
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if passthrough:
            headers.update(passthrough)
        headers.update(self._auth)
        return headers

    def forwarded_headers(self, passthrough: Mapping[str, str]) -> dict[str, str]:
        """The client headers this engine may see: trace context always, ``x-sim-*`` only on a
        simulated engine with ``forward_sim_headers`` on (elsewhere they are client-controlled
        fault injection and workload shaping, not something a real engine should be sent).
        """
        out: dict[str, str] = {}
        for name, value in passthrough.items():
            lower = name.lower()
            if lower in ("traceparent", "tracestate") or (
                self.forwards_sim_headers and lower.startswith("x-sim-")
            ):
                out[name] = value
        return out

    def prepare_body(self, body: dict[str, Any]) -> bool:
        """Adjust a parsed request body for this engine in place; return True if it changed.

        The default removes the vLLM ``priority`` field for engines that would reject it.
        """
        if "priority" in body and not self.accepts_priority:
            del body["priority"]
            return True
        return False

    # -- lifecycle hooks ---------------------------------------------------------------------------

    #: the engine can change P/D role while it runs (vLLM with a kv_both connector, the simulated
    #: engine); others are refused by the role flip
    switches_role: ClassVar[bool] = False

    def can_switch_role(self) -> str | None:
        """Why this engine cannot change role while it runs (None: it can)."""
        if not self.switches_role:
            return (
                f"{self.kind} engines cannot change role while they run (the role is a launch "
                "setting, e.g. SGLang's --disaggregation-mode): restart it in the new role"
            )
        return None

    async def switch_role(self, role: Role) -> None:
        """Tell the engine it now serves as ``role`` (called drained, by the admin role flip).

        vLLM engines run their KV connector as ``kv_both`` for flips, so a request's
        ``kv_transfer_params`` alone say which side it is: nothing to tell. Engines whose role is
        a server setting (the simulated engine's bootstrap mode) override this.
        """
        return None

    # -- monitoring ------------------------------------------------------------------------------

    async def health(self) -> bool | None:
        """True when the engine answers its health route with 2xx within the health timeout;
        None when the check could not be made for want of a socket in the gateway (no verdict
        on the engine: every engine would fail it alike)."""
        try:
            async with self.session.get(
                self.url(self.health_path),
                timeout=self._health_timeout,
                headers=self._auth,
                allow_redirects=False,
            ) as resp:
                await read_control(resp)
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if out_of_sockets(exc):
                return None
            self.note_refusal(exc)
            return False

    def note_refusal(self, exc: BaseException) -> None:
        """Record when a connection to the engine was refused (see :attr:`refused_at`)."""
        if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
            self.refused_at = time.monotonic()

    async def scrape(self) -> EngineState | None:
        """Read and parse the engine's metrics; None when it publishes none."""
        if self.metrics_path is None:
            return None
        async with self.session.get(
            self.url(self.metrics_path),
            timeout=self._scrape_timeout,
            headers=self._auth,
            allow_redirects=False,
        ) as resp:
            resp.raise_for_status()
            # (the text format is UTF-8)
            text = (await read_control(resp, MAX_METRICS_BODY)).decode(errors="replace")
        return self.parse_metrics(text)

    async def read_model_list(self) -> ModelList | None:
        """What the engine's model list says of it: the LoRA adapters loaded on its model (see
        :func:`adapters_listed`) and, for engines that answer only for the names they list,
        whether it lists the configured model; None when it publishes no model list (404, 405,
        501). Raises on other failures, like :meth:`scrape`."""
        if self.models_path is None:
            return None
        async with self.session.get(
            self.url(self.models_path),
            timeout=self._scrape_timeout,
            headers=self._auth,
            allow_redirects=False,
        ) as resp:
            if resp.status in (404, 405, 501):
                return None
            resp.raise_for_status()
            data = control_json(await read_control(resp))
        model = self.config.model
        listed = models_listed(data)
        serves = None if listed is None or not self.lists_served_model else model in listed
        return ModelList(adapters_listed(data, model), serves, listed or (), context_length(data, model))

    def parse_metrics(self, text: str) -> EngineState | None:
        return None


@dataclass(frozen=True, slots=True)
class ModelList:
    """An engine's ``/v1/models`` as the monitor reads it."""

    #: LoRA adapters loaded on the engine's configured model
    adapters: frozenset[str]
    #: whether the configured model is among the names listed; None: the list cannot tell (the
    #: engine kind answers whatever a body names, or the answer is no model list)
    serves_model: bool | None
    #: every model name listed (for the reason an engine is taken out of rotation)
    names: tuple[str, ...] = ()
    #: the context length the model's card gives (vLLM's ``max_model_len``), when it gives one
    max_model_len: int | None = None


def models_listed(data: Any) -> tuple[str, ...] | None:
    """The names of the cards in a model list (``data`` array or bare array); None when the
    answer is no model list."""
    cards = data.get("data") if isinstance(data, Mapping) else data
    if not isinstance(cards, list):
        return None
    return tuple(
        name for card in cards if isinstance(card, Mapping) and isinstance(name := card.get("id"), str)
    )


def context_length(data: Any, model: str) -> int | None:
    """The ``max_model_len`` that the model list's card for ``model`` gives (vLLM's, the
    simulated engine's), when it gives a positive integer."""
    cards = data.get("data") if isinstance(data, Mapping) else data
    for card in cards if isinstance(cards, list) else ():
        if isinstance(card, Mapping) and card.get("id") == model:
            length = card.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                return length
    return None


def adapters_listed(data: Any, model: str) -> frozenset[str]:
    """The LoRA adapters an engine's ``/v1/models`` lists on ``model``.

    vLLM lists the base model (``parent`` null) and each adapter as its own card whose ``parent``
    is the base model's served name (``root``: the adapter's path); recent SGLang does the same.
    An adapter counts only when its parent is ``model`` itself: an upstream that lists other
    models (a router, another gateway) must not make their adapters routable under this one's
    name, key and SLO. (vLLM names the first of several ``--served-model-name``s as the parent:
    configure the engine's model as that one.) Anything else (llama.cpp, generic servers: no
    ``parent``; a body that is not a model list) lists none. The payload's ``data`` array or a
    bare array both work.
    """
    cards = data.get("data") if isinstance(data, Mapping) else data
    if not isinstance(cards, list):
        return frozenset()
    return frozenset(
        name
        for card in cards
        if isinstance(card, Mapping)
        and isinstance(name := card.get("id"), str)
        and name
        and name != model
        and card.get("parent") == model
    )


def gauge(samples: prom_text.Samples, *names: str) -> float:
    value = prom_text.total(samples, *names)
    return 0.0 if value is None else value


def load_gauges(samples: prom_text.Samples, running: str, waiting: str) -> tuple[int, int]:
    """The engine's running and waiting request counts. An answer with neither gauge is no
    reading (ValueError: a failed scrape, so the state goes stale): read as zeros, an engine
    with its stats off, a proxy's page or a renamed metric looked idle and fresh, which hid its
    load and kept the stall check from ever judging it."""
    if running not in samples and waiting not in samples:
        raise ValueError(f"the metrics hold neither {running} nor {waiting}")
    return int(gauge(samples, running)), int(gauge(samples, waiting))
