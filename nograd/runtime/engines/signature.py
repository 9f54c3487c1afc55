"""An artifact's inputs and outputs, read from the artifact, for a config that leaves them out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch

from nograd.core.datatypes import TABLE
from nograd.runtime.config import ModelConfig, TensorSpec
from nograd.runtime.engines.artifacts import ArtifactError
from nograd.runtime.handler import TORCH_DTYPES

ONNX_DATATYPES: Final = {row.onnx: row.name for row in TABLE if row.onnx is not None}
_DATATYPE_OF_TORCH: Final = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def with_signature(config: ModelConfig, path: Path) -> ModelConfig:
    """``config`` with the inputs and outputs it omits read from the artifact at ``path``."""
    if config.inputs and config.outputs:
        return config
    if config.format == "onnx":
        inputs, outputs = _onnx_signature(path)
    elif config.format == "torch_export":
        inputs, outputs = _program_signature(path)
    else:
        raise ArtifactError(f"{path}: a {config.format} artifact needs inputs and outputs listed")
    return config.model_copy(
        update={"inputs": config.inputs or inputs, "outputs": config.outputs or outputs}
    )


def _spec(path: Path, name: str, datatype: str | None, shape: list[Any]) -> TensorSpec:
    if datatype is None:
        raise ArtifactError(f"{path}: {name!r} has a datatype nograd does not serve")
    if not shape:
        raise ArtifactError(f"{path}: {name!r} has no batch dimension")
    dims = tuple(dim if isinstance(dim, int) and dim > 0 else -1 for dim in shape[1:])
    return TensorSpec.model_validate({"name": name, "datatype": datatype, "shape": dims})


def _onnx_signature(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def specs(values: list[Any]) -> tuple[TensorSpec, ...]:
        return tuple(_spec(path, v.name, ONNX_DATATYPES.get(v.type), list(v.shape)) for v in values)

    return specs(session.get_inputs()), specs(session.get_outputs())


def program_names(program: Any) -> tuple[list[str], list[str] | None]:
    """The input and output names of a program traced as nograd traces (a dict in, a dict out);
    ``torch.export`` keeps them in its call spec. Output names are None for a tuple out."""
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    args = in_spec.children_specs[0] if in_spec is not None else None
    first = args.children_specs[0] if args is not None and args.children_specs else None
    if args is None or first is None or first.type is not dict or len(args.children_specs) != 1:
        raise ArtifactError("the program must take one dict of tensors, as nograd export writes")
    outputs = list(out_spec.context) if out_spec is not None and out_spec.type is dict else None
    return list(first.context), outputs


def _program_signature(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    program = torch.export.load(str(path))
    nodes = {node.name: node for node in program.graph.nodes}
    input_names, output_names = program_names(program)
    signature = program.graph_signature
    user_outputs = list(signature.user_outputs)
    if output_names is None:
        output_names = [f"output_{index}" for index in range(len(user_outputs))]

    def spec(node_name: str, label: str) -> TensorSpec:
        value = nodes[node_name].meta.get("val") if node_name in nodes else None
        if not isinstance(value, torch.Tensor):
            raise ArtifactError(f"{path}: {label!r} is not a tensor")
        shape = [dim if isinstance(dim, int) else -1 for dim in value.shape]
        return _spec(path, label, _DATATYPE_OF_TORCH.get(value.dtype), shape)

    inputs = tuple(
        spec(node, label) for node, label in zip(signature.user_inputs, input_names, strict=True)
    )
    outputs = tuple(
        spec(node, label) for node, label in zip(user_outputs, output_names, strict=True)
    )
    return inputs, outputs
