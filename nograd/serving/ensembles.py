"""Triton ensembles served: each request flows step to step through the step models' own
batchers, so ensemble traffic batches with the requests sent to those models directly.

An ensemble has no model, handler or batcher of its own. When it loads, its steps are checked
against the step models as Triton checks them (``ValidateEnsembleConfig`` and the dependency
graph of Triton's model repository manager, their messages word for word); it is ready while
every step model is. A request runs each step once all of that step's input tensors exist,
independent steps at once; a step's failure fails the request with the step's error, prefixed as
Triton prefixes it (``in ensemble '<name>', ``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Final

import numpy as np

from nograd.core.datatypes import TABLE
from nograd.observability.stats import Statistics
from nograd.observability.tracing import step_trace
from nograd.runtime.handler import Outputs
from nograd.schema.config import EnsembleStep, ModelConfig, TensorSpec
from nograd.serving.registry import ModelRegistry, ServedModel, State
from nograd.serving.trace_stamps import ensemble_queued

logger = logging.getLogger(__name__)
TRITON_TYPES: Final[dict[str, str]] = {row.name: row.triton for row in TABLE}

RunStep = Callable[[EnsembleStep, dict[str, np.ndarray]], Awaitable[Outputs]]
"""Runs one step's request on its model (the data plane's inference): its outputs by name."""
Infer = Callable[..., Awaitable[tuple[ServedModel, Outputs]]]
"""The data plane's inference: (name, version, inputs, timeout_s=, request_id=) to the version
that answered and its outputs."""


def is_ensemble(config: ModelConfig) -> bool:
    return config.runs_steps


def step_model(registry: ModelRegistry, step: EnsembleStep) -> ServedModel | None:
    """The version a step's requests go to: the pinned one, or the one a request naming no
    version gets (Triton's ``-1``)."""
    if step.version is None:
        return registry.models.get(step.model)
    return registry.versions.get(step.model, {}).get(step.version)


def waiting_for(registry: ModelRegistry, config: ModelConfig) -> str | None:
    """Why the ensemble is not ready (the first step model not ready, a nested ensemble's own
    steps counted), or None."""
    visited: set[tuple[str, str]] = set()
    for step in config.steps:
        if not _serving(registry, step, visited):
            version = "" if step.version is None else f" version {step.version}"
            return f"its step model '{step.model}'{version} is not ready"
    return None


def _serving(registry: ModelRegistry, step: EnsembleStep, visited: set[tuple[str, str]]) -> bool:
    """Whether ``step``'s model serves, a nested ensemble's steps with it. Walked with a visited
    set, not by recursion: ensembles that came to contain each other (refused at load,
    ``check_ensemble``) answer, never raise."""
    pending = [step]
    while pending:
        model = step_model(registry, pending.pop())
        if model is None:
            return False
        if model.waiting_for is None:
            if not model.ready:
                return False
            continue
        if model.state is not State.READY:
            return False
        if (model.name, model.version) not in visited:
            visited.add((model.name, model.version))
            pending.extend(model.config.steps)
    return True


# ---------------------------------------------------------------------------------- load checks
def load_order(ensembles: list[ServedModel]) -> list[ServedModel]:
    """Ensembles whose steps include other ensembles of the list after those."""
    names = {m.name for m in ensembles}
    ordered: list[ServedModel] = []
    left = list(ensembles)
    while left:
        done = {m.name for m in ordered}
        ready = [
            m for m in left if all(s.model in done or s.model not in names for s in m.config.steps)
        ]
        if not ready:  # a cycle: checked (and refused) in any order
            ready = left
        ordered.extend(ready)
        left = [m for m in left if m not in ready]
    return ordered


def check_ensemble(
    registry: ModelRegistry, model: ServedModel, in_repository: Callable[[str], bool]
) -> str | None:
    """Triton's load-time refusal of an ensemble, or None when its steps fit their models."""
    config = model.config
    name = config.name
    cycle = _cycle(registry, config)
    if cycle is not None:
        return cycle
    missing = sorted({s.model for s in config.steps if not in_repository(s.model)})
    if missing:
        return f"ensemble {name} contains models that are not available or ambiguous: " + ", ".join(
            missing
        )
    for step in config.steps:
        problem = _dependency(registry, name, step)
        if problem is not None:
            return problem
    tensors: dict[str, _Node] = {}
    batching = bool(config.batch_dimension)
    for spec in (*config.inputs, *config.outputs):
        tensors[spec.name] = _Node(name, batching, spec, reshaped=True)
    ensemble_rows = config.max_batch_size if batching else 0
    for step in config.steps:
        found = step_model(registry, step)
        assert found is not None  # _dependency saw it
        step_rows = (found.config.max_batch_size or 0) if found.config.batch_dimension else 0
        if step_rows != 0 and ensemble_rows is not None and step_rows < ensemble_rows:
            return (
                f"ensemble {name} allows maximum batch size {ensemble_rows}, but it contains "
                f"model {step.model} which only allows maximum batch size to be {step_rows}"
            )
        problem = _mapping(name, step, found.config, tensors)
        if problem is not None:
            return problem
    return None


def settle(registry: ModelRegistry, model: ServedModel, known: Callable[[str], bool]) -> bool:
    """Check ensemble ``model`` against its step models as loaded now: failed, with Triton's
    message, when it does not fit; else ready while its step models are. Whether it serves."""
    problem = check_ensemble(registry, model, known)
    if problem is not None:
        model.state, model.error = State.FAILED, f"failed to load: {problem}"
        logger.error("ensemble %s v%s %s", model.name, model.version, model.error)
        return False
    model.state, model.error = State.READY, None
    model.waiting_for = functools.partial(waiting_for, registry, model.config)
    return True


def _cycle(registry: ModelRegistry, candidate: ModelConfig) -> str | None:
    """Triton's refusal of ensembles that contain each other, for ``candidate`` as it would
    serve: its own steps from its config (a reload may turn a served model into an ensemble),
    every other model's from the versions served."""
    start = candidate.name

    def steps_of(name: str) -> list[str]:
        if name == start:
            return sorted({s.model for s in candidate.steps})
        versions = registry.versions.get(name, {})
        return sorted({s.model for m in versions.values() for s in m.config.steps})

    seen: set[str] = set()
    pending = [start]
    while pending:
        current = pending.pop()
        for upstream in steps_of(current):
            if upstream == start:
                return (
                    f"circular dependency between ensembles: {start} -> ... -> {current} -> {start}"
                )
            if upstream not in seen:
                seen.add(upstream)
                pending.append(upstream)
    return None


def _dependency(registry: ModelRegistry, name: str, step: EnsembleStep) -> str | None:
    versions = registry.versions.get(step.model, {})
    loaded = {v: m for v, m in versions.items() if m.state is not State.FAILED}
    prefix = f"ensemble '{name}' depends on '{step.model}'"
    if not loaded:
        failed = [m.error for m in versions.values() if m.error]
        why = registry.unloaded.get(step.model, "")
        if failed or why.startswith("failed"):
            error = failed[0] if failed else why
            return (
                f"{prefix} which has no loaded version. Model '{step.model}' loading failed "
                f"with error: {error}"
            )
        return f"{prefix} which has no loaded version."
    if step.version is not None and step.version not in loaded:
        return f"{prefix} whose required version {step.version} is not loaded."
    return None


class _Node:
    """An ensemble tensor's datatype and shape as one model declares it."""

    def __init__(
        self, model: str, batching: bool, spec: TensorSpec, *, reshaped: bool = False
    ) -> None:
        self.model = model
        self.datatype = spec.datatype
        # The ensemble's own tensors by their reshape (Triton's rule); a step model's by dims.
        self.dims = spec.reshape if reshaped and spec.reshape is not None else spec.shape
        self.full = (-1, *self.dims) if batching else self.dims


def _mapping(
    ensemble: str, step: EnsembleStep, config: ModelConfig, tensors: dict[str, _Node]
) -> str | None:
    """Triton's ``ValidateTensorMapping``: every input of the step model mapped once, to a
    tensor of its datatype and shape; every output mapped from one the model has."""
    where = f"in ensemble {ensemble}, "
    batching = bool(config.batch_dimension)
    inputs = {spec.name: spec for spec in config.inputs}
    for model_input, tensor in step.inputs:
        if model_input not in inputs:
            return (
                f"{where}ensemble tensor {tensor} is mapping to non-existing input "
                f"{model_input} in model {step.model}"
            )
    mapped = dict(step.inputs)
    for spec in config.inputs:
        if spec.name not in mapped:
            return (
                f"{where}input {spec.name} in model {step.model} is not mapped to any ensemble "
                "tensors"
            )
        problem = _consistent(where, mapped[spec.name], tensors, _Node(step.model, batching, spec))
        if problem is not None:
            return problem
    outputs = {spec.name: spec for spec in config.outputs}
    for model_output, tensor in step.outputs:
        if model_output not in outputs:
            return (
                f"{where}ensemble tensor {tensor} is mapped from non-existing output "
                f"{model_output} in model {step.model}"
            )
        node = _Node(step.model, batching, outputs[model_output])
        problem = _consistent(where, tensor, tensors, node)
        if problem is not None:
            return problem
    return None


def _consistent(where: str, tensor: str, tensors: dict[str, _Node], node: _Node) -> str | None:
    known = tensors.setdefault(tensor, node)
    if known is node:
        return None
    prefix = f"{where}ensemble tensor {tensor}: "
    if known.datatype != node.datatype:
        return (
            f"{prefix}inconsistent data type: {TRITON_TYPES[known.datatype]} is inferred from "
            f"model {known.model} while {TRITON_TYPES[node.datatype]} is inferred from model "
            f"{node.model}"
        )
    if not _dims_match(known.dims, node.dims) and not _dims_match(known.full, node.full):
        return (
            f"{prefix}inconsistent shape: {_dims(known.full)} is inferred from model "
            f"{known.model} while {_dims(node.full)} is inferred from model {node.model}"
        )
    return None


def _dims_match(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _dims(dims: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


# ---------------------------------------------------------------------------------- dependencies
def composing(
    configs: list[ModelConfig], seen: set[str], read: Callable[[str], list[ModelConfig] | None]
) -> list[str]:
    """The step models of ``configs`` and of the ensembles among them (their configs as
    ``read`` finds them on disk, None: not readable), each once, after its own step models; a
    cycle stops at the models already ``seen``. Walked with a stack, however deep the nesting."""

    def steps_of(found: list[ModelConfig] | None) -> Iterator[str]:
        return iter(sorted({s.model for config in found or () for s in config.steps} - seen))

    ordered: list[str] = []
    stack: list[tuple[str | None, Iterator[str]]] = [(None, steps_of(configs))]
    while stack:
        name, left = stack[-1]
        step = next(left, None)
        if step is None:
            stack.pop()
            if name is not None:
                ordered.append(name)
        elif step not in seen:
            seen.add(step)
            stack.append((step, steps_of(read(step))))
    return ordered


def step_models(registry: ModelRegistry, name: str) -> list[str]:
    """The step models the served ``name`` runs, nested ensembles' included, each after its own
    step models."""

    def read(model: str) -> list[ModelConfig]:
        return [m.config for m in registry.versions.get(model, {}).values()]

    return composing(read(name), {name}, read)


def used_by_ensemble(registry: ModelRegistry, name: str) -> bool:
    """Whether a served ensemble runs ``name`` as a step."""
    return any(step.model == name for m in registry.served() for step in m.config.steps)


# ---------------------------------------------------------------------------------- requests
async def compose(
    config: ModelConfig, inputs: Mapping[str, np.ndarray], run_step: RunStep
) -> Outputs:
    """One request through the ensemble's steps: each step starts once every tensor it takes
    exists; the ensemble's outputs are the tensors its config names."""
    tensors: dict[str, np.ndarray] = dict(inputs)
    waiting = list(config.steps)
    running: dict[asyncio.Task[Outputs], EnsembleStep] = {}
    try:
        while waiting or running:
            for step in [s for s in waiting if all(t in tensors for _, t in s.inputs)]:
                waiting.remove(step)
                given = {model_input: tensors[tensor] for model_input, tensor in step.inputs}
                running[asyncio.ensure_future(run_step(step, given))] = step
            if not running:
                # Checked at load: every output is computed from the inputs.
                raise RuntimeError(f"ensemble {config.name!r}: no step can run")
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step = running.pop(task)
                outputs = task.result()
                for model_output, tensor in step.outputs:
                    tensors[tensor] = outputs[model_output]
    except Exception as exc:
        exc.args = (f"in ensemble '{config.name}', {exc}", *exc.args[1:])
        raise
    finally:
        for task in running:
            task.cancel()
    return {spec.name: tensors[spec.name] for spec in config.outputs}


async def answer_ensemble(
    model: ServedModel,
    inputs: Mapping[str, np.ndarray],
    deadline: float | None,
    request_id: str | None,
    infer: Infer,
    statistics: Statistics,
) -> Outputs:
    """An ensemble's request, checked against the ensemble's inputs: each step a request of its
    own to its step model (its batcher, its statistics), within the request's deadline."""

    async def run_step(step: EnsembleStep, given: dict[str, np.ndarray]) -> Outputs:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with step_trace(step.model):
            _, outputs = await infer(
                step.model, step.version, given, timeout_s=timeout, request_id=request_id
            )
        return outputs

    ensemble_queued(model)
    started = time.perf_counter()
    outputs = await compose(model.config, inputs, run_step)
    # Triton counts one execution of the ensemble per request it answers.
    rows = len(next(iter(inputs.values()))) if model.config.batch_dimension else 1
    statistics.of(model.name).batch_finished(rows, time.perf_counter() - started, True)
    return outputs
