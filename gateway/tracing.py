"""OpenTelemetry spans for the data path: the request, its dispatch (and queue wait), its upstream calls.

Off by default, and off means off: :attr:`Tracing.tracer` is ``None`` and every call site tests
the request's span (``Call.span``) before doing anything, so a request pays a few ``is None``
tests: no span, no context, no clock read.

When on, nothing uses OpenTelemetry's "current span" (a contextvar attached and detached per
span): parents are passed explicitly, and spans whose extent is only known afterwards (dispatch,
queue wait) are made afterwards with explicit start and end times.

Trace context: the client's ``traceparent``/``tracestate`` is the parent of the request span, and
engines receive the upstream span's context instead, so an engine's own spans hang under the
gateway's. With tracing off the client's headers are forwarded unchanged (see
``EngineAdapter.forwarded_headers``).

Exporters (``tracing_exporter``): ``otlp`` (``otlp_protocol`` http/protobuf or grpc; needs the
``otlp`` extra, ``pip install 'slogate[otlp]'``), ``console``, or ``none`` (spans are made, batched
and dropped: the cost of tracing without an exporter's, for benchmarks).

Bounds: every string attribute is cut to :data:`MAX_ATTRIBUTE_LENGTH` characters (a value a client
controls, such as a model name, can never make a span huge), and :meth:`Tracing.shutdown` gives
the exporter :data:`SHUTDOWN_TIMEOUT_S` to flush, so an unreachable collector cannot hold up the
gateway's exit.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from policies.api import Role

if TYPE_CHECKING:
    from gateway.settings import Settings

#: one request through the gateway: arrival to the last byte (kind SERVER)
SPAN_REQUEST = "slogate.request"
#: one placement of the request: the dispatcher's decision, and the queue wait when it queued
SPAN_DISPATCH = "slogate.dispatch"
#: time the request waited in its model's admission queue (only when it did)
SPAN_QUEUE_WAIT = "slogate.queue_wait"
#: the upstream call, named by the engine's role: collocated today; prefill and decode with P/D
UPSTREAM_SPANS = {role: f"slogate.upstream.{role.value}" for role in Role}
#: event on the upstream span when the first streamed event arrives
EVENT_FIRST_TOKEN = "first_token"
#: event on the request span each time a stream is resumed on another engine (decode migration)
EVENT_MIGRATION = "slogate.migration"

OTLP_MODULES = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}

_PROPAGATOR = TraceContextTextMapPropagator()

log = logging.getLogger("slogate.tracing")

#: longest string attribute a span keeps (longer ones are cut): ids, names and numbers fit easily
MAX_ATTRIBUTE_LENGTH = 256
#: W3C trace context's own limit for ``traceparent`` and ``tracestate``; a longer header is ignored
#: here, before OpenTelemetry's propagator would log a warning for it on every request
MAX_TRACE_HEADER_LENGTH = 512
#: how long stopping the gateway waits for the last spans to be exported
SHUTDOWN_TIMEOUT_S = 3.0


class _QuietClientInput(logging.Filter):
    """Drops OpenTelemetry's warnings about what a client sent: an attribute cut to the span
    limits (cutting is meant here), a ``tracestate`` it cannot parse (malformed members, more
    than 32 of them; ignored, as W3C says). Those loggers are not the gateway's, so each was a
    plain-text line on stderr echoing the client's text, one per request a client chose to send."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_CLIENT_INPUT_WARNINGS = {
    "opentelemetry.attributes": ("String attribute value exceeds max length",),
    "opentelemetry.trace.span": (
        "Member doesn't match the w3c identifiers format",
        "There can't be more",
        "Duplicate key",
        "Invalid key/value pair",
    ),
}


def _quiet_client_input() -> None:
    for name, prefixes in _CLIENT_INPUT_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietClientInput) for f in logger.filters):
            logger.addFilter(_QuietClientInput(prefixes))


def otlp_available(protocol: str) -> bool:
    """Whether the OTLP exporter for ``protocol`` is installed (the ``otlp`` extra)."""
    try:
        return importlib.util.find_spec(OTLP_MODULES[protocol]) is not None
    except ModuleNotFoundError:  # a parent package is missing altogether
        return False


class DropExporter(SpanExporter):
    """Takes every span and keeps none: tracing's own cost, without an exporter's."""

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _exporter_for(settings: Settings) -> SpanExporter:
    kind = settings.tracing_exporter
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "none":
        return DropExporter()
    timeout = settings.otlp_timeout_s
    headers = dict(settings.otlp_headers) or None
    if settings.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=settings.otlp_endpoint, headers=headers, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=settings.otlp_endpoint, headers=headers, timeout=timeout)


class Tracing:
    """The gateway's tracer, or none. Spans carry ids, names and numbers, never keys or bodies."""

    def __init__(
        self,
        enabled: bool,
        exporter: SpanExporter | None = None,
        *,
        sample_ratio: float = 1.0,
        service_name: str = "slogate",
        batch: bool = True,
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    ) -> None:
        """``exporter`` receives the spans (a console exporter when None); ``batch=False`` exports
        each span as it ends (tests read them at once)."""
        self.enabled = enabled
        self.tracer: trace.Tracer | None = None
        self._provider: TracerProvider | None = None
        self._shutdown_timeout_s = shutdown_timeout_s
        if not enabled:
            return
        _quiet_client_input()
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            # explicit, so no OTEL_* variable can lift it: some attributes carry client text
            span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_LENGTH),
        )
        exporter = exporter if exporter is not None else ConsoleSpanExporter()
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self.tracer = self._provider.get_tracer("slogate")

    @classmethod
    def from_settings(cls, settings: Settings, exporter: SpanExporter | None = None) -> Tracing:
        """As configured; ``exporter`` (tests) replaces the configured one and exports at once."""
        if not settings.tracing:
            return cls(False)
        return cls(
            True,
            exporter if exporter is not None else _exporter_for(settings),
            sample_ratio=settings.tracing_sample_ratio,
            service_name=settings.tracing_service_name,
            batch=exporter is None,
        )

    # -- spans -------------------------------------------------------------------------------------

    def start_request(
        self, route: str, path: str, headers: Mapping[bytes, bytes], start_ns: int | None = None
    ) -> Span | None:
        """The request's span, child of the client's trace context when it sent a valid one;
        ``start_ns`` (wall clock) when it began before the span is made (authentication first)."""
        tracer = self.tracer
        if tracer is None:
            return None
        parent = None
        raw = headers.get(b"traceparent")
        # over-long headers are invalid (W3C): ignored quietly, where OpenTelemetry would log a
        # warning per request, which a client could use to flood the log
        if raw is not None and len(raw) <= MAX_TRACE_HEADER_LENGTH:
            carrier = {"traceparent": raw.decode("latin-1")}
            state = headers.get(b"tracestate")
            if state is not None and len(state) <= MAX_TRACE_HEADER_LENGTH:
                carrier["tracestate"] = state.decode("latin-1")
            parent = _PROPAGATOR.extract(carrier)
        return tracer.start_span(
            SPAN_REQUEST,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": path, "slogate.route": route},
            start_time=start_ns,
        )

    def child(
        self,
        parent: Span,
        name: str,
        attributes: Mapping[str, Any],
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        start_ns: int | None = None,
    ) -> Span:
        assert self.tracer is not None  # only called with a request span, which only exists when on
        return self.tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            kind=kind,
            attributes=attributes,
            start_time=start_ns,
        )

    @staticmethod
    def inject(span: Span, headers: dict[str, str]) -> None:
        """Make ``span`` the parent an engine sees: its ``traceparent`` (and the trace's
        ``tracestate``) replace whatever the client sent."""
        for name in [n for n in headers if n.lower() in ("traceparent", "tracestate")]:
            del headers[name]
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))

    def shutdown(self) -> None:
        """Export what is left and stop, waiting at most ``shutdown_timeout_s``.

        The SDK's own shutdown waits up to 30 s per processor, plus the exporter's retries, when
        the collector does not answer; a gateway being stopped (a rollout, a node drain) must not.
        Past the bound the flush carries on in a daemon thread and the spans still queued are
        lost with the process.
        """
        provider = self._provider
        if provider is None:
            return
        self._provider = None
        done = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
        done.start()
        done.join(self._shutdown_timeout_s)
        if done.is_alive():
            log.warning(
                "tracing: the span exporter did not finish within %.1f s; unexported spans are dropped",
                self._shutdown_timeout_s,
            )


def fail(span: Span, code: str | None, status: int | None = None) -> None:
    """Mark ``span`` failed with the error's code (and HTTP status when there is one)."""
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    span.set_attribute("error.type", code or (str(status) if status is not None else "error"))
    span.set_status(Status(StatusCode.ERROR))


def now_ns() -> int:
    """Span timestamps are wall-clock nanoseconds, as the SDK's own."""
    return time.time_ns()


__all__ = [
    "EVENT_FIRST_TOKEN",
    "EVENT_MIGRATION",
    "MAX_ATTRIBUTE_LENGTH",
    "MAX_TRACE_HEADER_LENGTH",
    "SPAN_DISPATCH",
    "SPAN_QUEUE_WAIT",
    "SPAN_REQUEST",
    "UPSTREAM_SPANS",
    "DropExporter",
    "Span",
    "SpanKind",
    "Tracing",
    "fail",
    "now_ns",
    "otlp_available",
]
