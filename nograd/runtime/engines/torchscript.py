"""TorchScript: a ``model.pt`` saved by ``torch.jit.save`` (Triton's PyTorch backend), loaded with
``torch.jit.load`` and run by torch under inference mode. nograd builds one from a python model
(``nograd export --to torchscript``) by tracing its forward as exported: positional inputs in the
order the handler collates them, a tuple of the config's outputs in its order.

A TorchScript module names no datatypes, so its config lists the inputs and outputs. They are
bound as Triton's PyTorch backend binds them: inputs by ``forward()``'s argument names, else by
the ``__N`` suffix of their names (``INPUT__0`` is argument 0), else in the config's order;
outputs by their ``__N`` suffix, else in the config's order (a dict returned is read by name).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from nograd.core.engines import EngineRow, engine_row
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.paths import EnginePath
from nograd.runtime.handler import ModelHandler

if TYPE_CHECKING:
    from nograd.runtime.engines.trace import Traced
    from nograd.schema.config import TensorSpec

logger = logging.getLogger(__name__)

_INDEXED: Final = re.compile(r"^.*__(\d+)$")


def suffix_order(names: Sequence[str]) -> list[int] | None:
    """Each name's ``__N`` index, when every name has one and they are 0..n-1; else None."""
    found = [_INDEXED.match(name) for name in names]
    if not all(found):
        return None
    indices = [int(match.group(1)) for match in found if match is not None]
    return indices if sorted(indices) == list(range(len(names))) else None


class TorchScriptPath(EnginePath):
    """A loaded TorchScript module; its inputs and outputs are bound once the config's are
    known (``check_inputs``)."""

    name = "torchscript"

    def __init__(self, module: torch.jit.ScriptModule, path: Path) -> None:
        super().__init__((), ())
        self.module = module
        self.path = path
        self.arguments = _forward_arguments(module)
        self._by_name = False
        self._positions: list[str] = []
        """Input names in the order of ``forward``'s positional arguments."""
        self._output_slots: list[int] = []
        """Per config output, the index of the result it is."""

    def check_inputs(self, handler: ModelHandler) -> None:
        """Bind the config's inputs to ``forward``'s arguments and its outputs to the results,
        or refuse the model when their counts differ."""
        # What the handler collates: the config's inputs, in its order, for a plain handler;
        # the tensors a model's own handler makes (token ids) for one exported by nograd.
        inputs = list(handler.collate([handler.example(1, 8)]))
        outputs = [spec.name for spec in handler.config.outputs]
        if self.arguments is not None and len(self.arguments) != len(inputs):
            raise ArtifactError(
                f"forward() takes {len(self.arguments)} argument(s) {self.arguments}, the config "
                f"lists {len(inputs)} input(s) {inputs}"
            )
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self._by_name = self.arguments is not None and set(inputs) == set(self.arguments)
        order = suffix_order(inputs)
        self._positions = inputs
        if not self._by_name and order is not None:
            self._positions = [name for _, name in sorted(zip(order, inputs, strict=True))]
        self._output_slots = suffix_order(outputs) or list(range(len(outputs)))

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return self.named(self.module(*self.arguments_of(batch)))

    def arguments_of(self, batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The batch's tensors as ``forward()``'s positional arguments."""
        names = self.arguments if self._by_name and self.arguments else self._positions
        return [batch[name] for name in names]

    def named(self, result: Any) -> dict[str, torch.Tensor]:
        """``forward()``'s result under the config's output names."""
        if isinstance(result, Mapping):
            missing = [name for name in self.outputs if name not in result]
            if missing:
                raise ArtifactError(f"{self.path}: forward() returned no output named {missing}")
            return {name: result[name] for name in self.outputs}
        results = [result] if isinstance(result, torch.Tensor) else list(result)
        if len(results) != len(self.outputs):
            raise ArtifactError(
                f"{self.path}: forward() returned {len(results)} tensor(s), the config lists "
                f"{len(self.outputs)} output(s)"
            )
        return {
            name: results[slot] for name, slot in zip(self.outputs, self._output_slots, strict=True)
        }


class ScriptedForward(torch.nn.Module):
    """A TorchScript model as the eager module of a handler that may choose another engine
    (``engine = "auto"``, opted in): it runs the TorchScript module, and under ``torch.export``
    the same graph converted to ATen operators, which export traces with a symbolic batch
    dimension (through the TorchScript interpreter every size would be a constant)."""

    def __init__(self, path: TorchScriptPath, handler: ModelHandler) -> None:
        super().__init__()
        self.path = path
        self.scripted = path.module
        self.converted = _converted(path, handler)

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.converted is not None and torch.compiler.is_exporting():
            return self.path.named(self.converted(*self.path.arguments_of(batch)))
        return dict(self.path.forward(batch))


def _converted(path: TorchScriptPath, handler: ModelHandler) -> torch.nn.Module | None:
    """The TorchScript graph as an ATen graph module, or None when it does not convert (then
    ``torch.export`` fails, the engines are refused, and TorchScript serves)."""
    from torch._export.converter import TS2EPConverter

    with torch.no_grad():
        example = handler.collate([handler.example(3)])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = TS2EPConverter(path.module, tuple(path.arguments_of(example))).convert()
        return _Converted(program.module())
    except Exception:
        logger.info("model %s: TorchScript not convertible for torch.export", handler.config.name)
        logger.debug("conversion failure", exc_info=True)
        return None


class _Converted(torch.nn.Module):
    """An exported program's module, kept out of ``train()``/``eval()`` (which it refuses)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def train(self, mode: bool = True) -> _Converted:
        return self

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.module(*tensors)


class _Positional(torch.nn.Module):
    """The exported forward (a dict in, a dict out) as TorchScript models take and give
    tensors: positional arguments, a tuple of outputs."""

    def __init__(
        self, module: torch.nn.Module, inputs: Sequence[str], outputs: Sequence[str]
    ) -> None:
        super().__init__()
        self.module = module
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = self.module(dict(zip(self.inputs, tensors, strict=True)))
        return tuple(result[name] for name in self.outputs)


def _forward_arguments(module: torch.jit.ScriptModule) -> list[str] | None:
    """``forward``'s argument names, ``self`` left out; None when its schema cannot be read."""
    try:
        arguments = module.forward.schema.arguments  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
    return [argument.name for argument in arguments if argument.name != "self"]


@dataclass(frozen=True)
class TorchScriptEngine:
    """``torch.jit.trace`` of the exported forward to build, ``torch.jit.load`` to open."""

    row: EngineRow

    def unsupported(self, device: torch.device) -> str | None:
        return None

    def build(self, traced: Traced, target: Path) -> None:
        module = _Positional(traced.forward, traced.inputs, traced.outputs)
        example = tuple(traced.example[name] for name in traced.inputs)
        with torch.no_grad(), warnings.catch_warnings():
            # torch deprecates TorchScript; Triton's PyTorch backend serves nothing else.
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.trace(  # type: ignore[no-untyped-call]
                module, example, check_trace=False
            )
            torch.jit.save(scripted, str(target))

    def open(self, path: Path, device: torch.device) -> EnginePath:
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
        module.eval()
        return TorchScriptPath(module, path)

    def signature(self, path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        raise ArtifactError(f"{path}: a TorchScript model names no datatypes; list its inputs")


TORCHSCRIPT: Final = TorchScriptEngine(engine_row("torchscript"))
