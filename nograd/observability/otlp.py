"""Traces as OpenTelemetry spans, sent over OTLP/HTTP (protobuf) to a collector, as Triton's
``opentelemetry`` trace mode sends them: an ``InferRequest`` span for the request, inside it a
span named for the model (events REQUEST_START, QUEUE_START, REQUEST_END), inside that a
``compute`` span (events COMPUTE_START, COMPUTE_END) when the model computed. An ensemble's
span holds one such model span per step. The caller's W3C ``traceparent`` makes the request
span its child.

The OpenTelemetry SDK batches the spans and sends them from its own thread. A collector that is
down or hung costs spans, never a request: the spans waiting are bounded
(``NOGRAD_OTLP_MAX_QUEUE_SIZE``, the oldest dropped), one export with its retries gives up after
``NOGRAD_OTLP_TIMEOUT_S``, and so does the server's stop waiting for the last spans; the SDK's
complaints are logged once in a while, not once per span.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nograd.observability.tracing import Trace, epoch_offset_ns

logger = logging.getLogger(__name__)

EXPORT_BATCH: Final = 512
"""Most spans in one export (the SDK's and Triton's default)."""
SDK_LOGGERS: Final = (
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
"""The SDK's loggers that repeat themselves while a collector is down (queue full, retries)."""
REPEAT_EVERY_S: Final = 10.0
COMPUTE: Final = ("COMPUTE_START", "COMPUTE_END")


class OnceInAWhile(logging.Filter):
    """Lets a message through once every ``interval_s``, counting the repeats it held back."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it not logged)"
        return True


def _quiet_sdk() -> None:
    for name in SDK_LOGGERS:
        sdk = logging.getLogger(name)
        if not any(isinstance(f, OnceInAWhile) for f in sdk.filters):
            sdk.addFilter(OnceInAWhile(REPEAT_EVERY_S))


class OtlpSpans:
    """Finished traces exported as spans to the collector at ``url``."""

    def __init__(
        self,
        url: str,
        service_name: str,
        export_delay_ms: float,
        *,
        max_queue_size: int = 2048,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        self._timeout_s = timeout_s
        _quiet_sdk()
        # Every trace nograd sampled is sent, whatever the caller's sampled flag says. The
        # server's stop ends the provider, within a bound; not the interpreter's exit.
        self._provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url, timeout=timeout_s),
                max_queue_size=max_queue_size,
                max_export_batch_size=min(EXPORT_BATCH, max_queue_size),
                schedule_delay_millis=export_delay_ms,
            )
        )
        self._tracer = self._provider.get_tracer("nograd")
        self._propagator = TraceContextTextMapPropagator()

    def write(self, trace: Trace, log_frequency: int, exhausted: bool) -> None:
        offset = epoch_offset_ns()
        parent: Context | None = None
        if trace.parent is not None:
            parent = self._propagator.extract({"traceparent": trace.parent})
        request = self._tracer.start_span(
            "InferRequest",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=trace.stamps["REQUEST_START"] + offset,
        )
        request.set_attribute("triton.request_id", trace.request_id)
        self._model_span(trace, set_span_in_context(request), offset)
        request.end(end_time=trace.stamps["REQUEST_END"] + offset)

    def _model_span(self, trace: Trace, inside: Context, offset: int) -> None:
        """The span of ``trace``'s model inside ``inside``, with its compute span and the spans
        of its child traces (an ensemble's steps)."""
        stamps = sorted((ns + offset, name) for name, ns in trace.stamps.items())
        model = self._tracer.start_span(
            trace.model, context=inside, kind=SpanKind.SERVER, start_time=stamps[0][0]
        )
        model.set_attribute("triton.model_name", trace.model)
        model.set_attribute(
            "triton.model_version", int(trace.version) if trace.version.isdigit() else -1
        )
        model.set_attribute("triton.trace_id", trace.id)
        model.set_attribute("triton.trace_parent_id", trace.parent_id)
        model.set_attribute("triton.request_id", trace.request_id)
        for ns, name in stamps:
            if name not in COMPUTE:
                model.add_event(name, timestamp=ns)
        at = {name: ns for ns, name in stamps}
        if all(name in at for name in COMPUTE):
            compute = self._tracer.start_span(
                "compute",
                context=set_span_in_context(model),
                kind=SpanKind.SERVER,
                start_time=at["COMPUTE_START"],
            )
            for name in COMPUTE:
                compute.add_event(name, timestamp=at[name])
            compute.end(end_time=at["COMPUTE_END"])
        for child in trace.children:
            self._model_span(child, set_span_in_context(model), offset)
        model.end(end_time=at.get("REQUEST_END", stamps[-1][0]))

    def close(self) -> None:
        """Send the spans still waiting, giving up after the export timeout (the SDK's own
        shutdown waits far longer for a hung collector); what is left is dropped."""
        closing = threading.Thread(
            target=self._provider.shutdown, name="nograd-otlp-shutdown", daemon=True
        )
        closing.start()
        closing.join(self._timeout_s)
        if closing.is_alive():
            logger.warning(
                "spans not sent to the OTLP collector at %s within %.1f s: dropped",
                self.url,
                self._timeout_s,
            )
