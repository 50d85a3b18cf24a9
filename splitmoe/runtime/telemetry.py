"""OpenTelemetry: one trace per request across gateway, attention and expert services.

Tracing is set up once per process with `setup_tracing`. With `OTEL_EXPORTER_OTLP_ENDPOINT` set,
spans go to that collector in batches; without it no exporter is installed and the SDK's
spans are dropped at record time, so the cost is a few microseconds per span. Context crosses
process boundaries in gRPC metadata (W3C `traceparent`), injected and extracted here so every
service does it the same way. No torch here: the gateway imports this module.
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

log = logging.getLogger(__name__)


def setup_tracing(service_name: str, otlp_endpoint: str | None = None,
                  extra_processors: Sequence[SpanProcessor] = ()) -> TracerProvider:
    """Install this process's tracer provider (once; later calls add processors to it)."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        provider = current
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(provider)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
        log.info("tracing: exporting spans of %s to %s", service_name, otlp_endpoint)
    for processor in extra_processors:
        provider.add_span_processor(processor)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_grpc_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC call metadata carrying the current span context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*metadata, *carrier.items()]


def extract_grpc_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's span context from incoming gRPC metadata (an empty context when absent)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
