"""The one core every transport calls: models, readiness, drain and inference.

HTTP routes (V2, OpenAI) stay thin and protocol-specific; everything they share lives here, so a
behaviour (validation, deadlines, metrics) is written once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import numpy as np

from nograd.batching import BatchingError
from nograd.core.errors import ModelAnswered
from nograd.core.responses import ResponseQueue
from nograd.formats.torchserve.reading.archives import ArchiveStore
from nograd.host.ledger import CoreLedger, CoreShare
from nograd.observability.metrics import Metrics
from nograd.observability.stats import Statistics
from nograd.protocol.limits import decoded_too_large
from nograd.runtime.handler import Outputs, TensorPart
from nograd.schema.sequence_step import SequenceStep
from nograd.serving.calls.admission import Admission
from nograd.serving.calls.heap_return import HeapReturn
from nograd.serving.calls.trace_stamps import request_part
from nograd.serving.calls.validation import (
    Declared,
    check_declared,
    decoded_bytes,
    prepared_part,
    remove_batch_dimension,
    squeeze_scalar_samples,
    validate,
)
from nograd.serving.control.loading import ModelLoader
from nograd.serving.control.repository import Wanted, model_names
from nograd.serving.errors import (
    Draining,
    InferenceFailed,
    ModelNotReady,
    rejection_reason,
)
from nograd.serving.extensions.ensembles import answer_ensemble, is_ensemble, load_order, settle
from nograd.serving.registry import ModelRegistry, ServedModel, State
from nograd.serving.residency.device_memory import memory_readings
from nograd.settings import Settings

logger = logging.getLogger(__name__)


class DataPlane:
    """Owns every model of the repository and runs inference on them."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        statistics: Statistics | None = None,
        *,
        cores: CoreShare | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.statistics = statistics or Statistics()
        self.registry = ModelRegistry()
        self.archive_store = ArchiveStore(
            settings.engine_cache_dir / "torchserve",
            settings.max_archive_bytes,
            settings.max_archive_members,
        )
        """Where TorchServe archives of the repository unpack, and the bounds they are held to."""
        self.models: dict[str, ServedModel] = self.registry.models
        """The registry's models by name (the same dict)."""
        self._loader = ModelLoader(settings, metrics, self.statistics, cores)
        self._cores: CoreLedger | None = None
        """The shared CPU-core ledger, once the loader joined it (several workers on a CPU)."""
        self._draining = False
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._loaded = asyncio.Event()
        self.admission = Admission(
            settings.max_requests_in_flight,
            settings.max_queue_wait_s,
            settings.max_body_bytes_in_flight,
        )
        self.heap_return = HeapReturn()
        metrics.watch_device_memory(lambda: memory_readings(self.registry))

    @property
    def config_errors(self) -> list[str]:
        return self.registry.config_errors

    # ------------------------------------------------------------------ lifecycle
    def discover(
        self,
        load: Callable[[str], bool] | None = None,
        wanted: Wanted | None = None,
    ) -> None:
        """Read every model config and register the models ``load`` selects (all without it;
        ``wanted`` names versions and overrides); a malformed config is logged and recorded."""
        root = self.settings.model_repository
        for model in self.registry.discover(root, load, wanted, self.archive_store):
            self.metrics.model_ready.labels(model.name).set(0)

    async def load_all(self) -> None:
        """Load the registered start-up set; the server turns ready once every one has loaded
        (or failed to)."""
        served = self.registry.served()
        await self._loader.load_all([m for m in served if not is_ensemble(m.config)])
        self._cores = self._loader.shares.ledger
        self._bind_ensembles([m for m in served if is_ensemble(m.config)])
        for name in list(self.registry.versions):
            self.registry.refresh(name)
        self._loaded.set()
        self.metrics.workers_ready.set(1)

    async def load_models(self, models: list[ServedModel]) -> None:
        """Load, warm up and plan ``models`` beside those serving (not registered: they take
        requests once registered)."""
        own = [m for m in models if not is_ensemble(m.config)]
        await self._loader.load_all(own, self.registry.served())
        self._cores = self._loader.shares.ledger
        self._bind_ensembles([m for m in models if is_ensemble(m.config)])

    def _bind_ensembles(self, ensembles: list[ServedModel]) -> None:
        """Check each ensemble's steps against the step models loaded (Triton's load-time
        checks); one that passes is loaded, and ready while its step models are."""
        if not ensembles:
            return  # no listing of the repository on the event loop for a plain model
        known = self._known_names()
        for model in load_order(ensembles):
            if model.state is State.LOADING and settle(self.registry, model, known):
                self.metrics.model_ready.labels(model.name).set(1)
                logger.info("ensemble %s v%s loaded", model.name, model.version)

    def _known_names(self) -> Callable[[str], bool]:
        """Whether a name is a model of the repository or one loaded (an ensemble's step)."""
        return (
            set(model_names(self.settings.model_repository)) | set(self.registry.versions)
        ).__contains__

    async def free(self, model: ServedModel) -> None:
        """Free a version taken out of the registry (unloaded, replaced, or failed to load)."""
        await self._loader.free(model)

    def replan(self) -> None:
        """Share each device's memory again among the models serving (after an unload)."""
        self._loader.replan(self.registry.served())

    def unmeasured(self, name: str) -> bool:
        """Whether a version of ``name`` serves on an estimate of its memory, not profiled."""
        return bool(self._loader.profiles.unmeasured(name))

    async def measure(self, name: str, stop: Callable[[], bool]) -> bool:
        """Profile the versions of ``name`` serving on an estimate and plan again on what was
        measured (``ModelLoader.measure``); False when one was not measured (``stop`` said so
        between two measurements, the server began to drain, or it failed)."""
        return await self._loader.measure(
            name, self.registry.served, lambda: self._draining or stop()
        )

    def mark_ready(self, name: str) -> None:
        """Export whether ``name`` has a ready version, and whether each ensemble is (an
        ensemble is ready while its step models are)."""
        for each in {name, *(m.name for m in self.registry.served() if is_ensemble(m.config))}:
            model = self.models.get(each)
            ready = model is not None and model.ready and not self._draining
            self.metrics.model_ready.labels(each).set(1 if ready else 0)

    def recheck_ensembles(self, step_model: str) -> None:
        """Check again the ensembles that run ``step_model`` (just loaded or reloaded, perhaps
        with another config), as Triton checks an ensemble's downstream again: one that no
        longer fits fails with Triton's message, one that fits again serves."""
        known: Callable[[str], bool] | None = None
        for model in self.registry.served():
            if not is_ensemble(model.config) or model.state is State.LOADING:
                continue
            if all(step.model != step_model for step in model.config.steps):
                continue
            known = known or self._known_names()  # listed only when an ensemble runs it
            failed = model.state is State.FAILED
            if settle(self.registry, model, known) and failed:
                logger.info("ensemble %s v%s fits its step models again", model.name, model.version)
            self.registry.refresh(model.name)
        self.mark_ready(step_model)

    def begin_drain(self) -> None:
        """Turn not-ready at once and refuse new work; accepted requests still finish."""
        self._draining = True
        for name in self.registry.versions:
            self.metrics.model_ready.labels(name).set(0)

    @property
    def idle(self) -> bool:
        """No request admitted (a front holds it, its body perhaps still arriving) or in
        inference."""
        return self._inflight == 0 and self.admission.in_flight == 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no accepted request is left (True) or the timeout passes (False)."""
        if self.idle:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def watch_batchers(self, interval_s: float = 1.0) -> None:
        """Restart batch loops that died, so a crashed loop costs seconds, not the pod; with
        several server processes, also publish this one's device memory each interval."""
        while True:
            await asyncio.sleep(interval_s)
            await self.restart_dead_batchers()
            self.metrics.sample_device_memory()

    async def restart_dead_batchers(self) -> int:
        restarted = 0
        for model in self.registry.served():
            if model.state is not State.READY or model.batcher is None or self._draining:
                continue
            if await model.batcher.restart_if_dead():
                restarted += 1
                self.metrics.batcher_restarts.labels(model.name).inc()
                logger.error("model %s: batch loop had died; restarted it", model.name)
        return restarted

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        self._draining = True
        for model in self.registry.served():
            if model.batcher is not None:
                await model.batcher.stop(drain_timeout_s)
            self.metrics.model_ready.labels(model.name).set(0)
        self.metrics.workers_ready.set(0)
        self._loader.threads.shutdown()

    # ------------------------------------------------------------------ health
    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    async def until_loaded(self) -> None:
        """Return once every model has been loaded (or has failed to)."""
        await self._loaded.wait()

    def ready(self) -> bool:
        """Ready when every model loaded and serves; a failed model keeps the server not ready."""
        return self.loaded and not self._draining and self.registry.all_ready()

    # ------------------------------------------------------------------ inference
    def admit(self, name: str | None, waited_s: float = 0.0) -> None:
        """Take in one inference request for model ``name`` (None: not known yet) before its
        body is read, ``waited_s`` after its head arrived, or refuse it (``Overloaded``,
        ``WaitTooLong``); every admitted request is released once answered."""
        if name is None:
            candidates = list(self.models.values())
        else:
            model = self.models.get(name)
            candidates = [] if model is None else [model]
        batchers = [m.batcher for m in candidates if m.ready and m.batcher is not None]
        self.admission.enter(batchers, waited_s)

    def release(self) -> None:
        self.admission.leave()
        self.heap_return.answered()
        self._signal_idle()

    def _signal_idle(self) -> None:
        if self._idle is not None and self.idle:
            self._idle.set()

    def get(self, name: str, version: str | None = None) -> ServedModel:
        return self.registry.get(name, version)

    def hold(self, name: str, version: str | None = None) -> ServedModel:
        """The version a request names (``ModelNotFound`` else), held from this lookup until
        ``ServedModel.let_go``: an unload or reload frees it once every request holding it is
        done."""
        model = self.registry.get(name, version)
        model.hold()
        return model

    def validate(self, model: ServedModel, inputs: Mapping[str, np.ndarray]) -> None:
        """Names, datatypes, per-sample shapes and row counts against the model's config."""
        validate(
            model,
            inputs,
            max_rows=self.settings.max_request_rows,
            max_text_bytes=self.settings.max_text_bytes,
        )

    def input_check(
        self, model: ServedModel, request_id: str | None = None
    ) -> Callable[[Declared], int]:
        """The check a front runs on a request's inputs for ``model`` as their headers declare
        them, before decoding any data (``check_declared`` with this server's row limit, then
        their size decoded within ``max_decoded_bytes``); it returns that size."""
        max_rows = self.settings.max_request_rows
        limit = self.settings.max_decoded_bytes

        def check(declared: Declared) -> int:
            started = time.perf_counter()
            try:
                check_declared(model, declared, max_rows=max_rows, request_id=request_id)
                size = decoded_bytes(declared)
                if size > limit:
                    raise decoded_too_large(size, limit, "the inputs this request declares")
            except Exception as exc:
                self._failed(model, exc, time.perf_counter() - started)
                raise
            return size

        return check

    async def infer(
        self,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray] | TensorPart,
        *,
        timeout_s: float | None = None,
        request_id: str | None = None,
        arrived: float | None = None,
        responder: ResponseQueue | None = None,
        sequence: SequenceStep | None = None,
        model: ServedModel | None = None,
        declared_checked: bool = False,
    ) -> tuple[ServedModel, Outputs]:
        """Validate, prepare and queue one request (of ``sequence``, its control and state
        tensors added once the client's inputs passed) for version ``model`` of ``name``, when
        the call already looked it up, else the one ``name`` and ``version`` find; a
        ``TensorPart`` is a request the model's runner takes as it came (a TorchServe
        prediction), queued as it is, with no tensor validation, batch dimension or ``prepare``;
        ``declared_checked``: its declared inputs passed ``input_check`` before they were
        decoded, so only what that check cannot see (texts, values) is validated here;
        ``timeout_s`` overrides the default;
        ``request_id`` is the protocol's own id, quoted by the refusals that Triton words.
        ``arrived`` (``time.perf_counter``): when its head arrived; the wait bound counts from
        there, so time spent reading, decoding, tokenising or behind a busy event loop counts."""
        if model is None:
            model = self.registry.get(name, version)
        timeout = timeout_s if timeout_s is not None else self.settings.request_timeout_s
        # From its arrival: its wait for an on-demand load and its body's reading count.
        spent = 0.0 if arrived is None else max(0.0, time.perf_counter() - arrived)
        deadline = None if timeout is None else time.monotonic() + timeout - spent
        # Statistics extension: every request that names a served model counts, failed or not.
        stats = self.statistics.of(model.name)
        started = time.perf_counter()
        cores = self._cores
        if self._inflight == 0 and cores is not None:
            cores.set_active(True)
        self._inflight += 1
        large = self.heap_return.is_large(
            inputs.tensors if isinstance(inputs, TensorPart) else inputs
        )
        # Counted from lookup (no await in between): an unload or reload frees this version only
        # once it is answered.
        model.hold()
        try:
            outputs = await self._infer(
                model, inputs, deadline, request_id, arrived, responder, sequence, declared_checked
            )
        except BaseException as exc:
            self._failed(model, exc, time.perf_counter() - started)
            raise
        finally:
            model.let_go()
            if large:
                self.heap_return.finished_large()
            self._inflight -= 1
            if self._inflight == 0:
                if cores is not None:
                    cores.set_active(False)
                self._signal_idle()
        if isinstance(inputs, TensorPart):
            rows = inputs.rows
        else:
            batched = model.config.batch_dimension is not False
            rows = len(next(iter(inputs.values()))) if batched else 1
        stats.request_succeeded(rows, time.perf_counter() - started)
        return model, outputs

    def _failed(self, model: ServedModel, exc: BaseException, seconds: float) -> None:
        """A request for ``model`` refused or failed, before or after its data was decoded: the
        same statistics and ``rejected`` count either way."""
        self.statistics.of(model.name).request_failed(seconds)
        reason = rejection_reason(exc)
        if reason is not None:
            self.metrics.rejected.labels(model.name, reason).inc()

    async def _infer(
        self,
        model: ServedModel,
        inputs: Mapping[str, np.ndarray] | TensorPart,
        deadline: float | None,
        request_id: str | None,
        arrived: float | None,
        responder: ResponseQueue | None = None,
        sequence: SequenceStep | None = None,
        declared_checked: bool = False,
    ) -> Outputs:
        name = model.name
        if self._draining:
            raise Draining(f"model {name!r} is not ready (server is draining)")
        if not model.ready or (model.waiting_for is None and model.handler is None):
            raise ModelNotReady(f"model {name!r} is not ready ({model.why_not_ready()})")
        if isinstance(inputs, TensorPart):
            part = inputs
        else:
            inputs = squeeze_scalar_samples(model, inputs)
            validate(
                model,
                inputs,
                max_rows=self.settings.max_request_rows,
                max_text_bytes=self.settings.max_text_bytes,
                request_id=request_id,
                declared_checked=declared_checked,
            )
            if model.waiting_for is not None:
                return await answer_ensemble(
                    model, inputs, deadline, request_id, self.infer, self.statistics
                )
            part = await prepared_part(model, inputs, sequence)
        assert model.batcher is not None
        # A decoupled model's responses, a sequence's step, a trace.
        part = request_part(model, part, responder, sequence)
        try:
            waited_s = 0.0 if arrived is None else max(0.0, time.perf_counter() - arrived)
            outputs = await model.batcher.submit(
                part,
                deadline=deadline,
                max_wait_s=self.settings.max_queue_wait_s,
                waited_s=waited_s,
            )
            return remove_batch_dimension(model, outputs)
        except BatchingError:
            raise
        except ModelAnswered:
            # The model's own answer (Triton's error responses): passed on as it wrote it.
            self.metrics.inference_errors.labels(name).inc()
            raise
        except Exception as exc:
            self.metrics.inference_errors.labels(name).inc()
            raise InferenceFailed(
                f"model {name!r} failed on this request: {type(exc).__name__}: {exc}"
            ) from exc
