"""A TorchServe handler as the batcher's runner (a ``RequestRunner``): each request a
``HandlerRequest`` (its fields and headers), each batch one ``handle(data, context)`` call on the
device thread, as TorchServe calls it (no ``inference_mode`` of nograd's around it), each answer
encoded as TorchServe sends it.

The handler is found as TorchServe's model loader finds it: a file of the archive
(``handler.py`` or ``handler.py:function``) or a default handler by name. A module with the
function (``handle`` unless named) is a function handler, called once with ``None`` at load; else
the module's one class is built without arguments, then ``initialize(context)``.
"""

from __future__ import annotations

import copy
import importlib
import io
import logging
import mimetypes
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np
import torch

from nograd.core.handler_messages import (
    RAW_FIELD,
    HandlerAnswer,
    HandlerRequest,
    decode_value,
    encode_answer,
    failure,
)
from nograd.formats.torchserve.reading.manifest import read_manifest
from nograd.formats.torchserve.running.imports import archive_imports
from nograd.formats.torchserve.running.ts import __version__ as TS_VERSION
from nograd.formats.torchserve.running.ts.context import Context, RequestProcessor
from nograd.formats.torchserve.running.ts.utils.util import (
    PredictionException,
    list_classes_from_module,
)
from nograd.runtime.handler import Outputs, TensorPart, module_bytes, split_rows
from nograd.runtime.memory import is_out_of_memory
from nograd.runtime.runners import RequestRunner
from nograd.schema.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_HANDLERS: Final = ("image_classifier", "image_segmenter")
"""TorchServe's default handlers nograd provides (``ts/torch_handler/``)."""
Entry = Callable[[Any, Context], Any]


class ArchiveLoadError(Exception):
    """An archive's handler that cannot be loaded; the message names the file and why."""


class ArchiveHandler(RequestRunner):
    """Runs a TorchServe handler on batches of ``HandlerRequest``s; with a sample request,
    ``example`` repeats it, so the model is warmed up and measured for memory like any other."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        entry: Entry,
        context: Context,
        code: dict[str, ModuleType],
        folder: Path,
    ) -> None:
        super().__init__(config, device)
        self.folder = folder
        """The unpacked archive: on the path while ``handle`` runs, for its lazy imports."""
        self.sample: HandlerRequest | None = None
        """The request warm-up and memory measurement repeat (``use_sample``)."""
        self.entry = entry
        self.context = context
        self.code = code
        """The archive's own modules, kept out of ``sys.modules`` (``imports.archive_imports``)."""

    def use_sample(self, path: Path) -> str | None:
        """Take the request in ``path`` (decoded by its file type as a body of that content
        type) as the model's example, once the handler answered it; else why not."""
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        try:
            body = path.read_bytes()
        except OSError as exc:
            return f"cannot read it: {exc}"
        sample = HandlerRequest(
            {RAW_FIELD: decode_value(body, content_type)},
            {RAW_FIELD: {"content-type": content_type}},
        )
        answer = self._handle([copy.deepcopy(sample)])[0]
        if answer.status != 200:
            return (
                f"the handler answered it {answer.status}: {answer.body.decode(errors='replace')}"
            )
        self.sample = sample
        self.synthetic_inputs = True
        return None

    def example(self, rows: int, length: int = 1, seed: int = 0) -> TensorPart:
        """``rows`` copies of the sample request (a handler may change what it is given)."""
        if self.sample is None:
            raise RuntimeError(f"model {self.config.name}: no sample request to make inputs of")
        array = np.empty(rows, dtype=np.object_)
        array[:] = [copy.deepcopy(self.sample) for _ in range(rows)]
        return TensorPart({RAW_FIELD: array}, rows)

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Requests as the TorchServe front made them; raw bytes (a V2 BYTES input) as a body
        sent with no content type, as ``curl -T`` sends a file."""
        items = [
            item
            if isinstance(item, HandlerRequest)
            else HandlerRequest({RAW_FIELD: _raw(item)}, {RAW_FIELD: {"content-type": ""}})
            for item in inputs[RAW_FIELD].reshape(-1)
        ]
        array = np.empty(len(items), dtype=np.object_)
        array[:] = items
        return TensorPart({RAW_FIELD: array}, len(items))

    def run_batch(self, parts: Sequence[TensorPart]) -> list[Outputs]:
        """Every part's requests in one ``handle`` call; each part gets its own answers."""
        requests = [item for part in parts for item in part.tensors[RAW_FIELD]]
        answers = np.empty(len(requests), dtype=np.object_)
        answers[:] = self._handle(requests)
        return split_rows({"answer": answers}, [part.rows for part in parts])

    def _handle(self, requests: list[HandlerRequest]) -> list[HandlerAnswer]:
        """One ``handle`` call for the batch, failing every request as TorchServe does: a
        ``PredictionException`` with its code, any other exception with 503. Running out of
        memory is raised instead, so the batcher splits the batch."""
        context = self.context
        context.request_processor = [RequestProcessor(dict(r.headers)) for r in requests]
        context.request_ids = {i: str(i) for i in range(len(requests))}
        try:
            with archive_imports(self.folder, self.code):
                results = self.entry([r.data for r in requests], context)
        except PredictionException as exc:
            return [failure(exc.error_code, exc.message)] * len(requests)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            logger.warning("model %s: the handler failed", self.config.name, exc_info=True)
            return [failure(503, "Prediction failed")] * len(requests)
        if not isinstance(results, list):
            return [failure(503, "Invalid model predict output")] * len(requests)
        if len(results) != len(requests):
            return [failure(503, "number of batch response mismatched")] * len(requests)
        answers = []
        for index, result in enumerate(results):
            answer = encode_answer(_saved(result))
            code, _ = context.get_response_status(index)
            content_type = context.get_response_content_type(index) or answer.content_type
            if code != 200 or content_type != answer.content_type:
                answer = HandlerAnswer(answer.body, content_type, code)
            answers.append(answer)
        return answers


def _saved(result: object) -> object:
    """A tensor answer as TorchServe sends it: the bytes of ``torch.save``."""
    if not isinstance(result, torch.Tensor):
        return result
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _raw(item: object) -> object:
    return bytearray(item) if isinstance(item, bytes | bytearray) else item


def build_archive_handler(
    model_dir: Path, config: ModelConfig, device: torch.device, repository: Path | None = None
) -> ArchiveHandler:
    """The archive's handler found, built and initialised as TorchServe's model loader does,
    with its sample request (``find_sample``) when it has one."""
    handler = _build(model_dir, config, device)
    sample = find_sample(model_dir, config.name, repository)
    problem = "none found" if sample is None else handler.use_sample(sample)
    if problem is None:
        logger.info(
            "model %s: sample request %s: warmed up and measured with it", config.name, sample
        )
    else:
        logger.warning(
            "model %s: no usable sample request (%s; put one beside the archive as "
            "%s.sample.<ext>, or in it as sample.<ext>): not warmed up or measured for memory, "
            "its batch limit is its batchSize, %d",
            config.name,
            problem if sample is None else f"{sample}: {problem}",
            config.name,
            config.max_batch_size or 1,
        )
    return handler


def find_sample(model_dir: Path, name: str, repository: Path | None) -> Path | None:
    """The model's sample request: ``<name>.sample.<ext>`` beside the archive in the
    repository (no archive rebuilt), else ``sample.<ext>`` inside it (``--extra-files``)."""
    places = [(model_dir, "sample")]
    if repository is not None:
        places.insert(0, (repository, f"{name}.sample"))
    for folder, stem in places:
        found = sorted(p for p in folder.glob(f"{stem}.*") if p.is_file())
        if found:
            return found[0]
    return None


def _build(model_dir: Path, config: ModelConfig, device: torch.device) -> ArchiveHandler:
    try:
        manifest, yaml_config = read_manifest(model_dir)
    except ValueError as exc:
        raise ArchiveLoadError(f"{model_dir}: {exc}") from exc
    handler = str(manifest["model"]["handler"])
    gpu = (device.index or 0) if device.type == "cuda" else None
    context = Context(
        config.name,
        str(model_dir),
        manifest,
        config.max_batch_size or 1,
        gpu,
        TS_VERSION,
        True,
        None,
        yaml_config,
    )
    code: dict[str, ModuleType] = {}
    with archive_imports(model_dir, code):
        module, function = _handler_module(model_dir, handler)
        try:
            if hasattr(module, function):
                entry: Entry = getattr(module, function)
                entry(None, context)
                service: object = None
            else:
                service = _handler_object(module, handler)
                service.initialize(context)  # type: ignore[attr-defined]
                entry = service.handle  # type: ignore[attr-defined]
        except ArchiveLoadError:
            raise
        except Exception as exc:
            raise ArchiveLoadError(
                f"{model_dir}: handler {handler!r} failed to initialise: {type(exc).__name__}: "
                f"{exc}"
            ) from exc
    runner = ArchiveHandler(config, device, entry, context, code, model_dir)
    model = getattr(service, "model", None)
    if isinstance(model, torch.nn.Module):
        runner.weights_bytes = module_bytes(model)
    return runner


def _handler_module(model_dir: Path, handler: str) -> tuple[ModuleType, str]:
    file, _, function = handler.partition(":")
    name = file.removesuffix(".py").split("/")[-1]
    if (model_dir / f"{name}.py").is_file() or (model_dir / name / "__init__.py").is_file():
        try:
            return importlib.import_module(name), function or "handle"
        except Exception as exc:
            raise ArchiveLoadError(
                f"{model_dir / (name + '.py')}: handler import failed: {type(exc).__name__}: {exc}"
            ) from exc
    if handler not in DEFAULT_HANDLERS:
        raise ArchiveLoadError(
            f"{model_dir}: handler {handler!r} is neither a file of the archive nor a default "
            f"handler nograd provides ({', '.join(DEFAULT_HANDLERS)})"
        )
    return importlib.import_module(f"ts.torch_handler.{handler}"), "handle"


def _handler_object(module: ModuleType, handler: str) -> object:
    classes = list_classes_from_module(module)
    if len(classes) != 1:
        raise ArchiveLoadError(
            f"handler {handler!r}: expected one class or a function entry point in "
            f"{module.__name__}, found classes {[c.__name__ for c in classes]}"
        )
    service = classes[0]()
    if not hasattr(service, "handle"):
        raise ArchiveLoadError(f"handler {handler!r}: class {classes[0].__name__} has no handle")
    return service
