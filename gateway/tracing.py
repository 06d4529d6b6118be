"""OpenTelemetry spans around dispatch and upstream calls (and queue wait, once requests queue).

Off by default: a disabled :class:`Tracing` hands out one shared no-op context manager, so the
hot path pays a method call, not a span. When on, spans go to an OTLP/HTTP endpoint if one is
configured (needs ``opentelemetry-exporter-otlp-proto-http``), else to the console.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

_NOOP = contextlib.nullcontext()


class Tracing:
    def __init__(
        self,
        enabled: bool,
        otlp_endpoint: str | None = None,
        service_name: str = "slogate",
        exporter: Any = None,
    ) -> None:
        """``exporter`` (an OpenTelemetry SpanExporter) overrides the OTLP/console choice."""
        self.enabled = enabled
        self._tracer: Any = None
        self._provider: Any = None
        if enabled:
            self._setup(otlp_endpoint, service_name, exporter)

    def _setup(self, otlp_endpoint: str | None, service_name: str, exporter: Any) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        if exporter is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_endpoint)
        elif exporter is None:
            exporter = ConsoleSpanExporter()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("slogate")

    def span(self, name: str, **attributes: str) -> AbstractContextManager[Any]:
        if self._tracer is None:
            return _NOOP
        return self._span(name, attributes)

    @contextlib.contextmanager
    def _span(self, name: str, attributes: dict[str, str]) -> Iterator[Any]:
        with self._tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
