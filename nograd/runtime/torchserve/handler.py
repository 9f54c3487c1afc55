"""A TorchServe handler as nograd's ``ModelHandler``: each request a ``HandlerRequest`` (its
fields and headers), each batch one ``handle(data, context)`` call on the device thread, each
answer encoded as TorchServe sends it.

The handler is found as TorchServe's model loader finds it: a file of the archive
(``handler.py`` or ``handler.py:function``) or a default handler by name. A module with the
function (``handle`` unless named) is a function handler, called once with ``None`` at load; else
the module's one class is built without arguments, then ``initialize(context)``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Final

import numpy as np
import torch

from nograd.core.handler_messages import (
    RAW_FIELD,
    HandlerAnswer,
    HandlerRequest,
    encode_answer,
    failure,
)
from nograd.runtime.config import ModelConfig
from nograd.runtime.handler import ModelHandler, Outputs, TensorPart
from nograd.runtime.memory import is_out_of_memory
from nograd.runtime.torchserve.imports import archive_imports
from nograd.runtime.torchserve.manifest import read_manifest
from nograd.runtime.torchserve.ts import __version__ as TS_VERSION
from nograd.runtime.torchserve.ts.context import Context, RequestProcessor
from nograd.runtime.torchserve.ts.utils.util import PredictionException, list_classes_from_module

logger = logging.getLogger(__name__)

DEFAULT_HANDLERS: Final = ("image_classifier",)
"""TorchServe's default handlers nograd provides (``ts/torch_handler/``)."""
Entry = Callable[[Any, Context], Any]


class ArchiveLoadError(Exception):
    """An archive's handler that cannot be loaded; the message names the file and why."""


class ArchiveHandler(ModelHandler):
    """Runs a TorchServe handler on batches of ``HandlerRequest``s."""

    synthetic_inputs: ClassVar[bool] = False

    def __init__(
        self,
        module: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        entry: Entry,
        context: Context,
        code: dict[str, ModuleType],
        folder: Path,
    ) -> None:
        super().__init__(module, config, device)
        self.folder = folder
        """The unpacked archive: on the path while ``handle`` runs, for its lazy imports."""
        self.entry = entry
        self.context = context
        self.code = code
        """The archive's own modules, kept out of ``sys.modules`` (``imports.archive_imports``)."""

    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Requests as the TorchServe front made them; raw bytes (a V2 BYTES input) as a body."""
        items = [
            item if isinstance(item, HandlerRequest) else HandlerRequest({RAW_FIELD: _raw(item)})
            for item in inputs[RAW_FIELD].reshape(-1)
        ]
        array = np.empty(len(items), dtype=np.object_)
        array[:] = items
        return TensorPart({RAW_FIELD: array}, len(items))

    def collate(self, parts: Sequence[TensorPart]) -> dict[str, Any]:
        return {RAW_FIELD: [item for part in parts for item in part.tensors[RAW_FIELD]]}

    def forward(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        requests: list[HandlerRequest] = batch[RAW_FIELD]
        answers = self._handle(requests)
        array = np.empty(len(answers), dtype=np.object_)
        array[:] = answers
        return {"answer": array}

    def to_numpy(self, outputs: Mapping[str, Any], rows: int | None = None) -> Outputs:
        return {"answer": outputs["answer"]}

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
            answer = encode_answer(result)
            code, _ = context.get_response_status(index)
            content_type = context.get_response_content_type(index) or answer.content_type
            if code != 200 or content_type != answer.content_type:
                answer = HandlerAnswer(answer.body, content_type, code)
            answers.append(answer)
        return answers


def _raw(item: object) -> object:
    return bytearray(item) if isinstance(item, bytes | bytearray) else item


def build_archive_handler(
    model_dir: Path, config: ModelConfig, device: torch.device
) -> ArchiveHandler:
    """The archive's handler found, built and initialised as TorchServe's model loader does."""
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
    model = getattr(service, "model", None)
    if not isinstance(model, torch.nn.Module):
        model = torch.nn.Module()
    return ArchiveHandler(model, config, device, entry, context, code, model_dir)


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
