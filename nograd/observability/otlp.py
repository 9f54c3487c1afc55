"""Traces as OpenTelemetry spans, sent over OTLP/HTTP (protobuf) to a collector, as Triton's
``opentelemetry`` trace mode sends them: an ``InferRequest`` span for the request, a span named
for the model inside it, and a ``compute`` span when the model computed; each timestamp is an
event of the model's span. The caller's W3C ``traceparent`` makes the request span its child.

The OpenTelemetry SDK batches the spans and sends them from its own thread; a collector that is
down costs lost spans (logged by the SDK), never a request.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nograd.observability.tracing import Trace, epoch_offset_ns


class OtlpSpans:
    """Finished traces exported as spans to the collector at ``url``."""

    def __init__(self, url: str, service_name: str, export_delay_ms: float) -> None:
        self.url = url
        # Every trace nograd sampled is sent, whatever the caller's sampled flag says.
        self._provider = TracerProvider(
            sampler=ALWAYS_ON, resource=Resource.create({"service.name": service_name})
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url), schedule_delay_millis=export_delay_ms
            )
        )
        self._tracer = self._provider.get_tracer("nograd")
        self._propagator = TraceContextTextMapPropagator()

    def write(self, trace: Trace, log_frequency: int, exhausted: bool) -> None:
        offset = epoch_offset_ns()
        stamps = {name: ns + offset for name, ns in trace.stamps.items()}
        start, end = stamps["REQUEST_START"], stamps["REQUEST_END"]
        parent: Context | None = None
        if trace.parent is not None:
            parent = self._propagator.extract({"traceparent": trace.parent})
        request = self._tracer.start_span("InferRequest", context=parent, start_time=start)
        request.set_attribute("triton.request_id", trace.request_id)
        inside = set_span_in_context(request)
        model = self._tracer.start_span(trace.model, context=inside, start_time=start)
        model.set_attribute("triton.model_name", trace.model)
        model.set_attribute("triton.model_version", trace.version)
        model.set_attribute("triton.request_id", trace.request_id)
        for name, ns in sorted(stamps.items(), key=lambda item: item[1]):
            model.add_event(name, timestamp=ns)
        if "COMPUTE_START" in stamps and "COMPUTE_END" in stamps:
            compute = self._tracer.start_span(
                "compute", context=set_span_in_context(model), start_time=stamps["COMPUTE_START"]
            )
            compute.end(end_time=stamps["COMPUTE_END"])
        model.end(end_time=end)
        request.end(end_time=end)

    def close(self) -> None:
        self._provider.shutdown()
