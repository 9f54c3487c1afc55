"""A Triton ensemble's ``ensemble_scheduling`` read and checked as Triton checks it when it reads
the config (``ValidateEnsembleSchedulingConfig`` in Triton's ``model_config_utils.cc``): every
step names a model and maps inputs and outputs, each ensemble tensor is written once, every
ensemble output can be computed from the inputs (a cycle cannot), and no tensor is left unused.
The messages are Triton's, word for word. The checks that need the step models' own configs
run when the ensemble loads (``nograd.serving.extensions.ensembles``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from nograd.schema.config import EnsembleStep


class _Tensor:
    """A node of the ensemble's data flow: an ensemble tensor, linked to those it is computed
    from (``before``) and those computed from it (``after``)."""

    def __init__(self, name: str, written: bool) -> None:
        self.name = name
        self.written = written
        self.ready = False
        self.before: list[_Tensor] = []
        self.after: list[_Tensor] = []


def ensemble_steps(message: Any) -> tuple[EnsembleStep, ...]:
    """The steps of ``message`` (a ``ModelConfig`` with platform ``ensemble``), checked; a
    ``ValueError`` carries Triton's message."""
    name = message.name
    if message.instance_group:
        raise ValueError(f"instance group should not be specified for ensemble '{name}'")
    if message.HasField("optimization"):
        raise ValueError(f"optimization should not be specified for ensemble '{name}'")
    if message.model_warmup:
        raise ValueError(f"model_warmup can not be specified for ensemble '{name}'")
    if not message.HasField("ensemble_scheduling"):
        raise ValueError(
            f"ensemble scheduling must be set for ensemble {name} whose platform is ensemble"
        )
    if not message.ensemble_scheduling.step:
        raise ValueError(f"must specify 'step' for ensemble '{name}'")
    tensors = _graph(message)
    _check_flow(message, tensors)
    return tuple(
        EnsembleStep(
            model=step.model_name,
            version=None if step.model_version < 0 else str(step.model_version),
            inputs=tuple(step.input_map.items()),
            outputs=tuple(step.output_map.items()),
        )
        for step in message.ensemble_scheduling.step
    )


def _graph(message: Any) -> dict[str, _Tensor]:
    """Triton's ``BuildEnsembleGraph``: each step's outputs computed from all its inputs."""
    name = message.name
    tensors: dict[str, _Tensor] = {}
    for index, step in enumerate(message.ensemble_scheduling.step):
        for field in ("model_name", "input_map", "output_map"):
            if not getattr(step, field):
                raise ValueError(f"must specify '{field}' in step {index} of ensemble '{name}'")
        written = []
        for tensor_name in step.output_map.values():
            tensor = tensors.get(tensor_name)
            if tensor is not None and tensor.written:
                raise ValueError(
                    f"ensemble tensor '{tensor_name}' can appear in an output map only once for "
                    f"ensemble '{name}' step {index}"
                )
            if tensor is None:
                tensor = tensors[tensor_name] = _Tensor(tensor_name, True)
            tensor.written = True
            written.append(tensor)
        for tensor_name in step.input_map.values():
            source = tensors.setdefault(tensor_name, _Tensor(tensor_name, False))
            for output in written:
                output.before.append(source)
                source.after.append(output)
    return tensors


def _check_flow(message: Any, tensors: dict[str, _Tensor]) -> None:
    """Every ensemble output reachable from the inputs, and every tensor used."""
    name = message.name
    queue: deque[_Tensor] = deque()
    for spec in message.input:
        tensor = tensors.get(spec.name)
        if tensor is None:
            # Triton's message, stray quote included.
            raise ValueError(f"ensemble input '{spec.name}' for ensemble {name}' is not used")
        tensor.ready = True
        queue.append(tensor)
    while queue:
        for after in queue.popleft().after:
            if not after.ready and all(before.ready for before in after.before):
                after.ready = True
                queue.append(after)
    outputs = set()
    for spec in message.output:
        tensor = tensors.get(spec.name)
        if tensor is None:
            raise ValueError(f"ensemble output '{spec.name}' for ensemble {name}' is not used")
        if not tensor.ready:
            raise ValueError(_not_written(name, tensor))
        outputs.add(spec.name)
    for tensor_name, tensor in tensors.items():
        if tensor_name not in outputs and (not tensor.ready or not tensor.after):
            raise ValueError(f"ensemble tensor '{tensor_name}' is unused in ensemble '{name}'")


def _not_written(name: str, output: _Tensor) -> str:
    """Triton's message for an output no step sequence computes, naming the first tensor up its
    chain that nothing connects to the inputs (a cycle stops at a tensor already seen)."""
    message = f"output '{output.name}' for ensemble '{name}' is not written"
    last = output
    seen: set[str] = set()
    before = output.before
    while before:
        nodes, before = before, []
        for node in nodes:
            if not node.ready and node.name not in seen:
                seen.add(node.name)
                last = node
                before = node.before
                break
    if last is not output:
        message += f": at least one of its depending tensors, '{last.name}', is not connected"
    return message
