"""One call's life, whatever front it came by: its key checked, admitted within the process's
bounds, given a deadline, submitted, answered; counted in flight meanwhile, and recorded once
(metrics, statistics' status, the log line).

A front decodes its wire format, drives a call through these steps, and encodes the answer or the
failure's ``Kind`` in its own status codes; nothing here knows HTTP or gRPC.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from random import getrandbits
from typing import Final

import numpy as np

from nograd.batching import QueueFull
from nograd.core.handler_messages import RAW_FIELD, HandlerAnswer, HandlerRequest
from nograd.core.responses import ResponseQueue
from nograd.observability.metrics import UNKNOWN_MODEL, Metrics
from nograd.observability.trace_file import TraceFile
from nograd.observability.trace_settings import TraceSetting, TraceSettings
from nograd.observability.tracing import Tracer
from nograd.protocol import classification
from nograd.runtime.handler import Outputs, TensorPart
from nograd.schema.sequence_step import SequenceStep
from nograd.serving.calls.access import Access
from nograd.serving.calls.validation import Declared
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import (
    DecodedTooLarge,
    Forbidden,
    HandlerFailed,
    InvalidInput,
    Kind,
    ModelNotFound,
    Unauthenticated,
    is_server_fault,
    kind_of,
)
from nograd.serving.extensions.sequences import Place, SequenceRequest, Sequences, refuse_sequence
from nograd.serving.extensions.shared_memory import SHARED, CallerRegions, SharedMemory
from nograd.serving.registry import ServedModel
from nograd.serving.residency.on_demand import OnDemand

logger = logging.getLogger("nograd.requests")

_SAFE_ID: Final = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def safe_request_id(given: str | None) -> str | None:
    """A caller's request id when it is a sane token (junk is never echoed or logged)."""
    return given if given is not None and _SAFE_ID.match(given) else None


class Call:
    """One call under way: who it is for the logs and metrics, and its deadline."""

    __slots__ = (
        "bytes_held",
        "held_models",
        "id_given",
        "inputs_checked",
        "model",
        "protocol",
        "request_id",
        "served",
        "started",
        "target",
        "timeout_s",
        "trace_parent",
    )

    def __init__(self, protocol: str, target: str, started: float, request_id: str | None) -> None:
        self.protocol = protocol
        self.target = target
        """What was called (an HTTP path, a gRPC method), for the log line."""
        self.started = started
        """When the call's head arrived (``time.perf_counter``), as early as its front knows."""
        self.id_given = request_id is not None
        # 128 random bits as 32 hex digits, like uuid4().hex, with no system call (os.urandom).
        self.request_id = request_id or getrandbits(128).to_bytes(16, "big").hex()
        self.model = UNKNOWN_MODEL
        """Metric label: the model once the name is known to be served."""
        self.timeout_s: float | None = None
        self.bytes_held = 0
        """Bytes of the process's budget this call holds for decoding (``Calls.hold_bytes``)."""
        self.held_models: tuple[str, ...] = ()
        """The model this call keeps resident until it is answered, and an ensemble's step
        models (on-demand control)."""
        self.trace_parent: str | None = None
        """The caller's W3C ``traceparent``: the parent of this call's trace, if sampled."""
        self.served: ServedModel | None = None
        """The model version the call named, looked up once (``Calls.input_check``, else
        ``Calls.infer``) and held from that lookup until the call is answered."""
        self.inputs_checked = False
        """Whether the inputs its request declares passed the model's check before they were
        decoded, so that the decoded arrays are not checked against it again."""

    def adopt_request_id(self, protocol_id: str | None) -> None:
        """Use the protocol's own id (the V2 ``id``) when the caller sent none of its own."""
        if not self.id_given and safe_request_id(protocol_id) is not None:
            assert protocol_id is not None
            self.request_id = protocol_id

    def shorten_deadline(self, timeout_s: float | None) -> None:
        """A deadline the request itself states; the earlier of it and the call's own wins."""
        if timeout_s is not None and (self.timeout_s is None or timeout_s < self.timeout_s):
            self.timeout_s = timeout_s


class Calls:
    """The steps every front takes for a call, over one data plane."""

    def __init__(
        self,
        plane: DataPlane,
        metrics: Metrics,
        access: Access | Sequence[str],
        on_demand: OnDemand | None = None,
        shared_memory: SharedMemory | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.plane = plane
        self.shared_memory = shared_memory or SharedMemory()
        """The system shared-memory regions inputs are read from and outputs written into."""
        self.metrics = metrics
        self.tracer = tracer or Tracer(TraceSettings(TraceSetting()), TraceFile(None))
        """Samples requests for Triton's trace extension (off unless set)."""
        self.access = access if isinstance(access, Access) else Access(access)
        """The keys calls must carry, and the API groups only operator keys open."""
        self._on_demand = on_demand
        settings = plane.settings
        self.sequences = Sequences(settings.max_sequences, settings.max_sequence_id_bytes)
        """The sequences under way of the sequence models."""

    @property
    def keys_required(self) -> bool:
        return self.access.keys_required

    def authorize(
        self,
        values: Sequence[str | bytes],
        protocol: str,
        model: str | None,
        group: str | None = None,
    ) -> None:
        """Check the ``authorization`` values a call carries (``Bearer <key>``) in constant time
        against every key, for a route of API ``group`` (None: no operator group); raise
        ``Unauthenticated`` or ``Forbidden`` naming what was wrong, never the key."""
        try:
            self.access.check(values, protocol, group)
        except Unauthenticated:
            self.metrics.rejected.labels(self.label(model), "unauthorized").inc()
            raise
        except Forbidden:
            self.metrics.rejected.labels(self.label(model), "forbidden").inc()
            raise

    def caller(self, values: Sequence[str | bytes]) -> str:
        """Whose call this is, for state a caller owns (shared-memory regions): the id of the
        key it carries (``Access.caller``: a digest, never the key), or ``SHARED`` on a server
        without keys, where every client is the same caller."""
        return self.access.caller(values) or SHARED

    def regions(self, call: Call, caller: str) -> CallerRegions:
        """The shared-memory regions ``call`` may use: its caller's. A BYTES input's bytes,
        which its declared shape does not size, are held before they are copied: their sum
        within ``max_decoded_bytes`` (else 422) and in the process's byte budget (else 503)."""
        limit = self.plane.settings.max_decoded_bytes
        copied = 0

        def hold(byte_size: int) -> None:
            nonlocal copied
            if copied + byte_size > limit:
                self.metrics.rejected.labels(call.model, "too_large").inc()
                raise DecodedTooLarge(
                    f"the request's BYTES inputs in shared memory would take {copied + byte_size} "
                    f"bytes copied out, more than the limit of {limit} bytes per request "
                    "(NOGRAD_MAX_DECODED_BYTES)"
                )
            self.hold_bytes(call, byte_size)
            copied += byte_size

        return self.shared_memory.of_caller(caller, hold)

    def admit(self, name: str | None, arrived: float | None = None) -> None:
        """Take in one inference call for model ``name`` (None: not known yet) before its body is
        read, or refuse it (``Overloaded``, ``WaitTooLong``); each admitted call is released.
        ``arrived`` (``time.perf_counter``): when its head arrived, if the front knows."""
        waited_s = 0.0 if arrived is None else max(0.0, time.perf_counter() - arrived)
        try:
            self.plane.admit(name, waited_s)
        except QueueFull as exc:
            self.metrics.rejected.labels(self.label(name), exc.reason).inc()
            raise

    def release(self) -> None:
        self.plane.release()

    async def resident(self, call: Call, name: str) -> None:
        """Under on-demand control, load model ``name`` if it is not resident (one load for
        every request waiting on it) and keep it resident until ``call`` is answered; an
        ensemble with its step models."""
        if self._on_demand is None or call.held_models:
            return
        call.held_models = self._on_demand.hold(name)
        try:
            await self._on_demand.ensure(call.held_models, self._time_left_s(call))
        except QueueFull as exc:  # LoadTooSlow, TooManyLoads
            self.metrics.rejected.labels(UNKNOWN_MODEL, exc.reason).inc()
            raise

    def _time_left_s(self, call: Call) -> float | None:
        """What is left of ``call``'s deadline (its own, else ``request_timeout_s``)."""
        timeout = (
            call.timeout_s if call.timeout_s is not None else self.plane.settings.request_timeout_s
        )
        if timeout is None:
            return None
        return timeout - (time.perf_counter() - call.started)

    def described(self, name: str, version: str | None = None) -> ServedModel:
        """The model (or version) ``name`` for its metadata, config or readiness: the one
        served, or under on-demand control one of the repository that is not resident, as its
        config describes it, without loading it; ``ModelNotFound`` else."""
        try:
            return self.plane.get(name, version)
        except ModelNotFound:
            unloaded = None if self._on_demand is None else self._on_demand.described(name, version)
            if unloaded is None:
                raise
            return unloaded

    def hold_bytes(self, call: Call, size: int) -> None:
        """Draw ``size`` bytes of the budget for decoding ``call``'s request, or refuse
        (``BodyBytesOverBudget``, counted); given back when the call closes."""
        self.take_bytes(size, call.model)
        call.bytes_held += size

    def input_check(
        self, call: Call, name: str, version: str | None, protocol_id: str | None = None
    ) -> Callable[[Declared], None]:
        """The serving core's check of the inputs a request declares (``DataPlane.input_check``:
        the model, the limits, the decoded size), holding that size for ``call`` once passed;
        ``protocol_id`` is the request's own id (the V2 ``id``), which Triton's refusals quote."""
        check = self.plane.input_check(self.served(call, name, version), protocol_id)

        def check_and_hold(declared: Declared) -> None:
            self.hold_bytes(call, check(declared))
            call.inputs_checked = True

        return check_and_hold

    def served(self, call: Call, name: str, version: str | None) -> ServedModel:
        """The version ``call`` names: looked up (``ModelNotFound`` else) and held once, on the
        call's first step that needs it; given back when the call closes."""
        if call.served is None:
            call.served = self.plane.hold(name, version)
        return call.served

    def take_bytes(self, size: int, name: str | None) -> None:
        """Draw ``size`` bytes of a body (or of decoding it) for model ``name`` from the
        process's byte budget, or refuse (``BodyBytesOverBudget``, counted); each draw is given
        back with ``give_bytes`` once its request is answered."""
        try:
            self.plane.admission.take_bytes(size)
        except QueueFull as exc:
            self.metrics.rejected.labels(self.label(name), exc.reason).inc()
            raise

    def give_bytes(self, size: int) -> None:
        self.plane.admission.give_bytes(size)

    def label(self, name: str | None) -> str:
        """The metric label of a model name: itself when served, else one shared value."""
        return name if name is not None and name in self.plane.models else UNKNOWN_MODEL

    def open(
        self,
        protocol: str,
        target: str,
        request_id: str | None = None,
        started: float | None = None,
    ) -> Call:
        """A call begins: counted in flight until ``close``."""
        self.metrics.inflight.inc()
        return Call(protocol, target, started or time.perf_counter(), request_id)

    async def infer(
        self,
        call: Call,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray],
        protocol_id: str | None = None,
        *,
        responder: ResponseQueue | None = None,
        sequence: SequenceRequest | None = None,
        place: Place | None = None,
    ) -> tuple[ServedModel, Outputs]:
        """One inference; ``protocol_id`` is the request's own id (the V2 ``id``), if any. A
        TorchServe handler's answers come as their bodies (``predict`` takes them whole). A
        decoupled model's responses go
        to ``responder`` (a streaming call's); any other call to one is refused as Triton does.
        A sequence model's request runs as the next of its ``sequence`` (behind the requests
        that took a ``place`` before it, ``Sequences.take_place``); any other model refuses a
        request naming one."""
        call.model = self.label(name)
        served = self.served(call, name, version)
        if responder is None and served.config.decoupled:
            where = "ModelInfer RPC" if call.protocol == "grpc" else "HTTP end point"
            raise InvalidInput(f"{where} doesn't support models with decoupled transaction policy")
        sequence = sequence or SequenceRequest()
        if served.config.sequence is None:
            refuse_sequence(name, sequence)

        def run(step: SequenceStep | None = None) -> Awaitable[tuple[ServedModel, Outputs]]:
            return self.plane.infer(
                name,
                version,
                inputs,
                model=served,
                declared_checked=call.inputs_checked,
                timeout_s=call.timeout_s,
                request_id=protocol_id,
                arrived=call.started,
                responder=responder,
                sequence=step,
            )

        tracer = self.tracer
        trace = tracer.begin(name, call.request_id, call.trace_parent) if tracer.active else None
        try:
            if served.config.sequence is None:
                model, outputs = await run()
            else:
                model, outputs = await self.sequences.infer(served, sequence, inputs, run, place)
        finally:
            if trace is not None:
                tracer.end(trace)
        return model, answer_bodies(outputs)

    async def predict(self, call: Call, name: str, request: HandlerRequest) -> HandlerAnswer:
        """One TorchServe prediction, its answer whole: the request as the front read it reaches
        the archive's handler as it came, one row (``DataPlane.infer`` given a part: no tensor
        validation, batch dimension or re-wrapping on the way)."""
        call.model = self.label(name)
        requests = np.empty(1, dtype=np.object_)
        requests[0] = request
        part = TensorPart({RAW_FIELD: requests}, 1)
        tracer = self.tracer
        trace = tracer.begin(name, call.request_id, call.trace_parent) if tracer.active else None
        try:
            # The version ``served`` looked up and holds.
            model, timeout, arrived = call.served, call.timeout_s, call.started
            _, outputs = await self.plane.infer(
                name, None, part, timeout_s=timeout, arrived=arrived, model=model
            )
        finally:
            if trace is not None:
                tracer.end(trace)
        answer: HandlerAnswer = outputs["answer"][0]
        return answer

    def failed(self, call: Call, exc: BaseException) -> Kind:
        """The kind of a call's failure; the model or nograd failing is logged with its trace."""
        kind = kind_of(exc)
        if is_server_fault(kind):
            logger.error(
                "%s call %s on model %s failed",
                call.protocol,
                call.target,
                call.model,
                exc_info=exc,
            )
        return kind

    def close(self, call: Call, status: int) -> None:
        """The call is answered with ``status`` (its kind's, for every protocol): recorded, and
        the bytes and the model version it held given back."""
        self.metrics.inflight.dec()
        if call.held_models and self._on_demand is not None:
            self._on_demand.release(call.held_models)
            call.held_models = ()
        if call.bytes_held:
            self.give_bytes(call.bytes_held)
            call.bytes_held = 0
        if call.served is not None:
            call.served.let_go()
            call.served = None
        seconds = time.perf_counter() - call.started
        self.metrics.request_done(call.model, call.protocol, status, seconds)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s %s -> %d in %.1f ms",
                call.protocol,
                call.target,
                status,
                seconds * 1000,
                extra={
                    "request_id": call.request_id,
                    "model": call.model,
                    "protocol": call.protocol,
                    "status": status,
                    "duration_ms": round(seconds * 1000, 3),
                },
            )


CLIENT_GONE: Final = Kind.CLIENT_GONE.status


def answer_bodies(outputs: Outputs) -> Outputs:
    """Outputs holding a TorchServe handler's answers, as the answers' bodies (a BYTES output of
    V2 and gRPC); an answer that is a failure fails the call: a 4xx as the request's fault, any
    other status as the model's, with the handler's message."""
    plain: Outputs = {}
    for name, array in outputs.items():
        if (
            array.dtype != np.object_
            or not array.size
            or not isinstance(array.flat[0], HandlerAnswer)
        ):
            plain[name] = array
            continue
        bodies = np.empty(array.shape, dtype=np.object_)
        for index, answer in enumerate(array.flat):
            if answer.status != 200:
                message = answer.body.decode("utf-8", "replace")
                text = f"the model's handler answered {answer.status}: {message}"
                raise InvalidInput(text) if 400 <= answer.status < 500 else HandlerFailed(text)
            bodies.flat[index] = answer.body
        plain[name] = bodies
    return plain


def classified(
    model: ServedModel, outputs: Mapping[str, np.ndarray], counts: Mapping[str, int]
) -> Mapping[str, np.ndarray]:
    """A model's answer with the outputs ``counts`` names as their top classes (Triton's
    classification extension), labelled with the model's own labels of each output."""
    if not counts:
        return outputs
    labels = {spec.name: spec.labels for spec in model.config.outputs}
    batched = bool(model.config.batch_dimension)
    return classification.classified(outputs, counts, labels, batched=batched)
