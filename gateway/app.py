"""The gateway ASGI application.

A thin front door routes the three OpenAI data-path routes straight to :class:`Proxy` as plain
ASGI handlers (no FastAPI request model, no middleware stack: about half the per-request CPU of
a FastAPI route, see the performance notes); everything else (models, health, readiness,
metrics, the status page, admin) is a FastAPI app behind it, which also owns the lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gateway import metrics
from gateway.api.auth import Authenticator, AuthError
from gateway.api.errors import GatewayError, described, send_error
from gateway.api.host_check import HostCheck
from gateway.api.proxy import Proxy
from gateway.api.request_parse import RouteKind
from gateway.dashboard.decisions import DecisionLog
from gateway.dashboard.state import (
    PAGE,
    PAGE_HEADERS,
    STATE_HEADERS,
    Attainment,
    dashboard_state,
    parse_state_query,
)
from gateway.dispatch.build import RoutingProfile, build_core, build_prefix_routing, kv_event_feed
from gateway.dispatch.loop import DispatchLoop
from gateway.dispatch.slo_service import SloService
from gateway.engines import adapter_for
from gateway.fleet import engine_tokenizer
from gateway.fleet.calibration import Calibrator
from gateway.fleet.kv_events import KVEventFeed
from gateway.fleet.monitor import FleetMonitor
from gateway.fleet.prefix_routing import PrefixRouting
from gateway.fleet.registry import Fleet
from gateway.fleet.roles import flip_role
from gateway.runtime import LoopLagProbe, export_gc_pauses
from gateway.serving.call import Receive, Scope, Send
from gateway.serving.collocated import CollocatedFlow
from gateway.serving.disaggregated import DisaggregatedFlow
from gateway.serving.responses import Responses
from gateway.settings import Settings, settings_warnings, without_credentials
from gateway.state.redis_store import RedisStore
from gateway.state.replica_load import ReplicaLoad
from gateway.state.replica_routes import ReplicaRoutes
from gateway.tracing import Tracing
from policies.api import Role

log = logging.getLogger("slogate.app")

_DATA_ROUTES: dict[str, RouteKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}


class Gateway:
    """Process-wide state, created when the app starts and closed when it stops."""

    def __init__(self, settings: Settings, span_exporter: SpanExporter | None = None) -> None:
        """``span_exporter`` (tests) receives the spans instead of the configured exporter."""
        self.settings = settings
        # Every profile is read and validated here, before anything binds or connects.
        self.routing = RoutingProfile.load(settings.routing_profile_path())
        self.slo = SloService(settings)
        self.auth = Authenticator(settings)
        self.tracing = Tracing.from_settings(settings, span_exporter)
        self.decisions = DecisionLog(settings.dashboard_decisions) if settings.dashboard_decisions else None
        self.attainment = Attainment()
        self.session: aiohttp.ClientSession | None = None
        self.control_session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None
        self.fleet: Fleet | None = None
        self.monitor: FleetMonitor | None = None
        self.calibrator: Calibrator | None = None
        self.dispatch: DispatchLoop | None = None
        self.prefix: PrefixRouting | None = None
        self.kv_events: KVEventFeed | None = None
        self.proxy: Proxy | None = None
        self.flow: DisaggregatedFlow | None = None
        self.replicas: ReplicaLoad | None = None
        self.routes: ReplicaRoutes | None = None
        self.started_at = time.time()
        #: set when stopping begins (the server stopped accepting): /ready turns 503 at once
        self.stopping = False
        #: ends what is still open when the shutdown's grace is over (see begin_shutdown)
        self._cut_timer: asyncio.TimerHandle | None = None
        self.lag_probe = LoopLagProbe()

    async def start(self) -> None:
        s = self.settings
        # what holds the loop stalls every stream: timed from the start (gateway.runtime)
        export_gc_pauses()
        self.lag_probe.start()
        # every engine tokenizer loaded and compiled (in threads) before the gateway serves: no
        # request loads one on the loop; one that cannot be loaded stops start-up here
        await engine_tokenizer.preload(s.engine_tokenizers)
        connector = aiohttp.TCPConnector(
            limit=s.upstream_pool_size,
            limit_per_host=s.upstream_pool_per_host,
            # below the engines' own keep-alive (vLLM/uvicorn: 5 s): an engine closing an idle
            # connection just as the gateway reuses it fails that request before its first byte
            keepalive_timeout=s.upstream_keepalive_s,
            enable_cleanup_closed=True,
        )
        # Engines' answers are relayed as they come and read on the way (usage, [DONE], errors):
        # ask for them uncompressed. aiohttp offers gzip, deflate and br by default, and an
        # engine behind a compressing proxy then sent bytes the client took for JSON.
        plain = {"Accept-Encoding": "identity"}
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=["User-Agent"], headers=plain
        )
        # a retry after a stale pooled connection goes out on a connection of its own
        self.fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=s.upstream_pool_size, force_close=True),
            auto_decompress=False,
            skip_auto_headers=["User-Agent"],
            headers=plain,
        )
        # Health checks, scrapes and model lists have a pool of their own: in the data path's
        # pool they waited for a free connection behind long streams, inside their own timeout,
        # so the busiest engines failed their health checks and were ejected.
        self.control_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=s.upstream_keepalive_s, enable_cleanup_closed=True
            ),
            skip_auto_headers=["User-Agent"],
        )
        adapters = [
            adapter_for(
                e,
                self.control_session,
                s.health_timeout_s,
                scrape_timeout_s=s.scrape_timeout_s,
                forward_sim_headers=s.forward_sim_headers,
            )
            for e in s.engines
        ]
        self.fleet = Fleet(adapters, s.stale_after_s)
        _warn_of_idle_decode_engines(s)
        # the latency models learn from the engine steps the fleet's streams and scrapes show
        self.slo.attach(self.fleet, time.monotonic, s.latency_step_gap_s)
        self.monitor = FleetMonitor(
            self.fleet,
            s.monitor_interval_s,
            s.eject_after_failures,
            s.readmit_after_successes,
            scrape_timeout_s=s.scrape_timeout_s,
            stall_after_s=s.stall_after_s,
        )
        self.monitor.start()
        if s.state_store == "redis":
            assert s.redis_url is not None
            store = RedisStore(s.redis_url, s.state_store_timeout_s)
            self.replicas = ReplicaLoad(
                self.fleet,
                store,
                s.replica_id,
                s.replica_sync_interval_s,
                s.replica_push_delay_s,
                s.state_store_timeout_s,
                namespace=s.state_namespace,
            )
            self.replicas.start()
        else:
            metrics.REPLICAS.set(1)
        # Serve with real health information rather than guessing: wait for one round of checks.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.monitor.first_round.wait(), s.health_timeout_s + 1.0)
        # the prefix index and the affinity store, when the routing profile reads them; the
        # engines' KV events keep the index exact from now on
        self.prefix = build_prefix_routing(s, self.fleet, self.routing)
        self.kv_events = kv_event_feed(s, self.prefix)
        if self.replicas is not None and self.prefix is not None:
            # every replica's dispatches feed every replica's prefix index and session map
            replicas = self.replicas
            self.routes = ReplicaRoutes(
                self.prefix,
                replicas.store,
                s.replica_id,
                replicas.has_peers,
                s.replica_push_delay_s,
                namespace=s.state_namespace,
                sessions_ttl_s=s.affinity_ttl_s,
                max_sessions=s.affinity_max_sessions,
            )
            self.routes.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self.dispatch = DispatchLoop(build_core(s, self.fleet, self.slo, self.routing, self.prefix))
        if self.replicas is not None:
            # (replicas break ties between equally loaded engines in different orders)
            self.dispatch.core.router.offset_ties(zlib.crc32(s.replica_id.encode()))
        self.dispatch.start()
        collocated = CollocatedFlow(
            s,
            self.fleet,
            self.dispatch,
            self.slo,
            self.session,
            self.tracing,
            self.decisions,
            fresh_session=self.fresh_session,
        )
        flow = self.flow = DisaggregatedFlow(self.fleet, collocated, self.slo, self.routing.dispatcher)
        # (replicas share where each stored Responses API answer is: a continuation through
        # another replica goes to its engine at once)
        responses = Responses(
            self.fleet,
            self.session,
            s.headers_timeout_s,
            s.idle_timeout_s,
            self.replicas.store if self.replicas is not None else None,
            s.state_namespace,
        )
        self.proxy = Proxy(
            s, self.fleet, self.slo, flow, self.auth, self.prefix, self.dispatch.core.router, responses
        )
        if s.calibration:
            self.calibrator = Calibrator(
                self.fleet, self.slo.latency, self.session, interval_s=s.calibration_interval_s
            )
            self.calibrator.start()

    def begin_shutdown(self) -> None:
        """The server stopped accepting (SIGTERM, Ctrl-C) and waits for open requests: they get
        ``shutdown_grace_s``, then whatever is still open is ended (:meth:`Proxy.cut_open`),
        each with an answer that says so, rather than cut by the platform's kill."""
        if self._cut_timer is not None:
            return
        self.stopping = True
        grace = self.settings.shutdown_grace_s
        open_now = self.proxy.open_requests if self.proxy is not None else 0
        if open_now:
            log.warning(
                "stopping: %d open requests get up to %g s to finish (from a terminal, Ctrl-C "
                "again ends them now)",
                open_now,
                grace,
            )
        self._cut_timer = asyncio.get_running_loop().call_later(grace, self._cut)

    def cut_now(self) -> None:
        self.begin_shutdown()  # (the server may not have begun its own stop yet: /ready, the log)
        assert self._cut_timer is not None
        self._cut_timer.cancel()
        self._cut("told to stop again")

    def _cut(self, why: str | None = None) -> None:
        if self.proxy is None:
            return
        ended = self.proxy.cut_open()
        if ended:
            why = why or f"the shutdown grace of {self.settings.shutdown_grace_s:g} s is over"
            log.warning("%s: %d open requests ended with shutting_down", why, ended)

    async def stop(self) -> None:
        self.stopping = True
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        self.lag_probe.stop()
        if self.calibrator is not None:
            await self.calibrator.stop()
        if self.proxy is not None:
            self.proxy.parser.close()
            self.proxy.keyer.close()
            await self.proxy.responses.close()  # (before the store closes)
        if self.dispatch is not None:
            await self.dispatch.stop()
        if self.flow is not None:
            self.flow.collocated.outliers.close()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.routes is not None:
            await self.routes.stop()
        if self.replicas is not None:
            await self.replicas.stop()  # (closes the store the routes shared)
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.session is not None:
            await self.session.close()
        if self.fresh_session is not None:
            await self.fresh_session.close()
        if self.control_session is not None:
            await self.control_session.close()
        self.tracing.shutdown()


Guard = Callable[[Authenticator, Mapping[bytes, bytes]], object]


def _guard_for(path: str) -> Guard | None:
    """Which key a non-data route needs, by path prefix so every future admin route is covered
    (and an unknown one answers 401 rather than telling an anonymous caller it does not exist)."""
    path = path.rstrip("/")
    if path == "/admin" or path.startswith("/admin/") or path == "/openapi.json":
        return Authenticator.admin  # (the API description lists every admin route)
    if path == "/metrics":
        return Authenticator.metrics
    if path == "/dashboard" or path.startswith("/dashboard/"):
        return Authenticator.dashboard
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return Authenticator.client
    return None  # /health and /ready stay open for probes, which carry no key


class FrontDoor:
    """ASGI entry point: OpenAI data routes go straight to the proxy, the rest to FastAPI."""

    def __init__(self, gateway: Gateway, api: FastAPI) -> None:
        self.gateway = gateway
        self.api = api
        self._hosts = HostCheck(gateway.settings.host, gateway.settings.allowed_hosts)

    def begin_shutdown(self) -> None:
        """Called by the server as it stops accepting (see :class:`gateway.server.GatewayServer`)."""
        self.gateway.begin_shutdown()

    def cut_now(self) -> None:
        """Called by the server when told to stop again: what is open ends now, not at the grace."""
        self.gateway.cut_now()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._hosts.names is not None and (refused := self._hosts.refusal(scope["headers"])):
                await send_error(send, refused)
                return
            kind = _DATA_ROUTES.get(scope["path"])
            proxy = self.gateway.proxy
            if kind is not None and proxy is not None:
                await proxy.handle(kind, scope, receive, send)
                return
            if scope["path"].startswith("/v1/responses/") and proxy is not None:
                await proxy.handle_response_item(scope, receive, send)
                return
            guard = _guard_for(scope["path"])
            if guard is not None:
                try:
                    guard(self.gateway.auth, dict(scope["headers"]))
                except AuthError as error:
                    await send_error(send, error)
                    return
        await self.api(scope, receive, send)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, headers=headers, media_type="application/json")


#: the largest body an admin route reads (they take a few fields)
ADMIN_BODY_BYTES = 64 * 1024


async def _small_body(request: Request, timeout_s: float) -> bytes:
    """An admin request's body, within ``timeout_s`` and ADMIN_BODY_BYTES (a client that stops
    sending it held the handler and its connection for good)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > ADMIN_BODY_BYTES:
                    raise GatewayError(
                        413, f"request body exceeds {ADMIN_BODY_BYTES} bytes", code="request_too_large"
                    )
                chunks.append(chunk)
    except TimeoutError:
        error = GatewayError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout"
        )
        error.extra_headers = ((b"connection", b"close"),)  # (the rest would be read as a request)
        raise error from None
    except ClientDisconnect:
        raise GatewayError(400, "the client left before its request body arrived") from None
    return b"".join(chunks)


def _error_response(error: GatewayError) -> Response:
    headers = {k.decode(): v.decode() for k, v in error.headers() if k != b"content-type"}
    return _json(error.payload(), error.status, headers)


def _warn_of_idle_decode_engines(settings: Settings) -> None:
    """A model with decode engines and collocated ones but no prefill engine is served whole on
    the collocated engines: its decode engines take work only once an engine is flipped to
    prefill. Allowed (a flip may come), but not without a word."""
    roles: dict[str, set[str]] = {}
    for engine in settings.engines:
        roles.setdefault(engine.model, set()).add(engine.role.value)
    for model, present in sorted(roles.items()):
        if "decode" in present and "prefill" not in present:
            log.warning(
                "model %r has decode engines but no prefill engine: its requests run whole on its "
                "collocated engines, and the decode engines take none until an engine is flipped "
                "to prefill (POST /admin/engines/{id}/role)",
                model,
            )


def _dispatching(loop: DispatchLoop | None) -> bool:
    return loop is not None and loop.running


def build_api(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:  # (a start that fails half-way closes what it opened: sessions, tasks)
            await gateway.start()
            yield
        finally:
            await gateway.stop()

    api = FastAPI(
        title="slogate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json"
    )

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error = GatewayError(exc.status_code, str(exc.detail))
        # (a 405's Allow header, naming the methods the route takes)
        error.extra_headers = tuple((k.encode(), v.encode()) for k, v in (exc.headers or {}).items())
        return _error_response(error)

    def get(path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A GET route that answers HEAD as well (a load balancer's or monitor's probe); the
        schema lists the GET only (one operation per route)."""

        def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
            routed = api.get(path)(endpoint)  # (first: a 405 names the methods of the first match)
            api.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
            return routed

        return register

    def fleet() -> Fleet:
        if gateway.fleet is None:
            raise StarletteHTTPException(503, "gateway is starting")
        return gateway.fleet

    @get("/v1/models")
    async def models() -> Response:
        created = int(gateway.started_at)
        f = fleet()
        data: list[dict[str, Any]] = [
            {"id": m, "object": "model", "created": created, "owned_by": "slogate"}
            for m in sorted(f.models())
        ]
        # LoRA adapters the engines have loaded, as vLLM lists them: their base model as parent
        data.extend(
            {"id": a, "object": "model", "created": created, "owned_by": "slogate", "parent": base}
            for a, base in sorted(f.adapter_bases.items())
        )
        return _json({"object": "list", "data": data})

    @get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        """One served model, or a LoRA adapter an engine has loaded, as ``/v1/models`` lists it
        (the SDK's ``models.retrieve``)."""
        if not model:  # (/v1/models/: the list)
            listed: Response = await models()
            return listed
        f = fleet()
        created = int(gateway.started_at)
        card: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "slogate"}
        if model in f.models():
            return _json(card)
        base = f.adapter_bases.get(model)
        if base is not None:
            return _json({**card, "parent": base})
        return _error_response(
            GatewayError(
                404, f"The model {described(model)} does not exist", param="model", code="model_not_found"
            )
        )

    @get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness of this process: started, its dispatch loop running, and at least one model
        with a healthy engine. A model with none is listed in ``unroutable`` but does not take
        the replica out of a load balancer (every replica shares the fleet: removing them all
        for one dead model would refuse the models that work). ``?all=1`` asks instead whether
        every served model has a healthy engine, for alerting."""
        every = request.query_params.get("all", "") in ("1", "true")
        f = fleet()
        # probes carry no key: with keys set, an anonymous caller learns whether the replica is
        # ready, not which models it serves (GET /v1/models needs a client key)
        auth = gateway.auth
        named = not auth.admin_auth or auth.identify(dict(request.headers.raw)).role != "anonymous"
        models = sorted(f.models())
        flow = gateway.flow
        # (a model served disaggregated needs its decode engines as well; see DisaggregatedFlow)
        unroutable = sorted(
            m for m in models if not (flow.routable(m) if flow is not None else f.has_healthy(m))
        )
        reason = None
        if gateway.stopping:
            reason = "shutting down"
        elif not _dispatching(gateway.dispatch):
            reason = "the dispatch loop is not running"
        elif not f.records:
            reason = "no engines configured"
        elif len(unroutable) == len(models) or (every and unroutable):
            which = ", ".join(unroutable) if named else f"{len(unroutable)} of {len(models)} models"
            reason = f"no healthy engine for: {which}"
        if reason is not None:
            return _error_response(GatewayError(503, f"not ready: {reason}", code="not_ready"))
        if not named:
            return _json({"status": "ready", "models": len(models), "unroutable": len(unroutable)})
        return _json({"status": "ready", "models": models, "unroutable": unroutable})

    @get("/metrics")
    async def prometheus() -> Response:
        if gateway.prefix is not None:
            gateway.prefix.observe()
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @get("/dashboard")
    async def dashboard() -> Response:
        return Response(PAGE, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @get("/dashboard/state")
    async def dashboard_data(request: Request) -> Response:
        try:
            limit = parse_state_query(request.query_params, gateway.settings.dashboard_decisions)
            full = gateway.auth.dashboard_in_full(dict(request.headers.raw))
            state = dashboard_state(gateway, gateway.attainment, limit, full)
        except GatewayError as error:
            refused = _error_response(error)
            refused.headers.update(STATE_HEADERS)
            return refused
        return _json(state, headers=STATE_HEADERS)

    @get("/admin/engines")
    async def engines() -> Response:
        out: list[dict[str, Any]] = []
        f = fleet()
        stale = {e.engine_id: e.stale for e in f.snapshot().engines}
        scrape_errors = gateway.monitor.scrape_errors if gateway.monitor is not None else {}
        for r in f.records.values():
            out.append(
                {
                    "id": r.engine_id,
                    "url": without_credentials(r.adapter.base_url),
                    "kind": r.adapter.kind,
                    "model": r.model,
                    "role": r.adapter.role.value,
                    "healthy": r.healthy,
                    "draining": r.draining,  # (a role flip under way)
                    "role_unsure": r.role_unsure,  # (a failed flip left its role unknown)
                    "stalled": r.stalled,  # (work held, no progress: out of rotation)
                    "ejected": r.tripped,  # (failed requests in a row: out of rotation for a while)
                    "in_flight": r.in_flight,
                    # (other gateway replicas' requests there, as last exchanged: docs/replicas.md)
                    "other_replicas_in_flight": r.remote_in_flight,
                    "last_error": r.last_error or None,
                    "state": asdict(r.state) if r.state else None,
                    "state_age_s": round(time.monotonic() - r.state_at, 3) if r.state else None,
                    "state_stale": stale.get(r.engine_id, True),
                    "scrape_error": scrape_errors.get(r.engine_id),
                    "adapters": sorted(r.adapters),
                }
            )
        return _json({"engines": out})

    @api.post("/admin/engines/{engine_id}/role")
    async def engine_role(engine_id: str, request: Request) -> Response:
        """Drain the engine, switch it to ``{"role": ...}`` and put it back (gateway.fleet.roles).
        ``drain_timeout_s`` (default 60) bounds the drain; past it the role stays. ``allow_gap``
        (default false) lets a model's only front engine flip, its requests refused meanwhile."""
        f = fleet()
        try:
            if engine_id not in f.records:
                raise GatewayError(
                    404, f"no engine {engine_id!r}", param="engine_id", code="engine_not_found"
                )
            stopping = GatewayError(503, "gateway is shutting down", code="shutting_down", retry_after_s=1.0)
            if gateway.stopping:
                # (a drain begun now would hold the shutdown, and the cut of open requests would
                # end it half-way through the switch)
                raise stopping
            media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                # A page in a browser on this machine may POST text/plain anywhere without asking
                # first (no CORS preflight), and with no admin keys (the default) nothing else
                # stood between it and a role flip; JSON makes the browser ask, and we never agree
                raise GatewayError(
                    415,
                    "the body must be JSON sent with Content-Type: application/json",
                    code="unsupported_media_type",
                )
            try:
                body = orjson.loads(await _small_body(request, gateway.settings.body_timeout_s))
            except orjson.JSONDecodeError:
                body = None
            role = body.get("role") if isinstance(body, dict) else None
            if not isinstance(role, str) or role not in {r.value for r in Role}:
                raise GatewayError(
                    400, 'body must be {"role": "collocated"|"prefill"|"decode"}', param="role"
                )
            drain = body.get("drain_timeout_s", 60.0) if isinstance(body, dict) else 60.0
            if isinstance(drain, bool) or not isinstance(drain, int | float) or not 0 <= drain <= 3600:
                raise GatewayError(
                    400, "drain_timeout_s must be a number of seconds in 0..3600", param="drain_timeout_s"
                )
            allow_gap = body.get("allow_gap", False) if isinstance(body, dict) else False
            if not isinstance(allow_gap, bool):
                raise GatewayError(400, "allow_gap must be true or false", param="allow_gap")
            if gateway.stopping:  # (again: the body may have taken up to body_timeout_s)
                raise stopping
            flip = await flip_role(f, engine_id, Role(role), float(drain), allow_gap)
        except GatewayError as error:
            return _error_response(error)
        return _json(
            {
                "id": flip.engine_id,
                "role": flip.role.value,
                "before": flip.before.value,
                "drained_s": round(flip.drained_s, 3),
            }
        )

    return api


def create_app(settings: Settings, *, span_exporter: SpanExporter | None = None) -> FrontDoor:
    """The ASGI app for ``settings``; engines are contacted only when the lifespan starts."""
    for warning in settings_warnings(settings):
        log.warning("%s", warning)
    gateway = Gateway(settings, span_exporter)
    return FrontDoor(gateway, build_api(gateway))
