"""An ensemble's steps checked against its step models when it loads, in Triton's words: models
missing or not loaded, inputs and outputs the step model lacks, datatypes and shapes that
disagree, a batch size the step cannot take, and ensembles that contain each other."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from nograd.schema.config import EnsembleStep, ModelConfig, TensorSpec
from nograd.serving.control.control_calls import unload_parameters
from nograd.serving.control.repository import ModelSource, VersionSource
from nograd.serving.errors import InvalidInput
from nograd.serving.extensions.ensembles import (
    check_ensemble,
    composing,
    load_order,
    settle,
    waiting_for,
)
from nograd.serving.registry import ModelRegistry, ServedModel, State, with_step_models


def _model(registry: ModelRegistry, config: ModelConfig, state: State = State.READY) -> ServedModel:
    model = ServedModel(config, Path("."), state=state)
    registry.add(model)
    return model


def _step_model(rows: int = 8, datatype: str = "FP32", dims: tuple[int, ...] = (4,)) -> ModelConfig:
    return ModelConfig(
        name="m",
        format="onnx",
        artifact="model.onnx",
        max_batch_size=rows,
        inputs=(TensorSpec(name="A", datatype=datatype, shape=dims),),
        outputs=(TensorSpec(name="B", datatype="FP32", shape=(4,)),),
    )


def _ensemble(name: str = "e", model: str = "m", input_name: str = "A") -> ModelConfig:
    step = EnsembleStep(model=model, inputs=((input_name, "X"),), outputs=(("B", "Y"),))
    return ModelConfig(
        name=name,
        format="ensemble",
        weights=None,
        max_batch_size=8,
        inputs=(TensorSpec(name="X", datatype="FP32", shape=(4,)),),
        outputs=(TensorSpec(name="Y", datatype="FP32", shape=(4,)),),
        steps=(step,),
    )


@pytest.mark.parametrize(
    ("step", "ensemble", "message"),
    [
        (_step_model(), _ensemble(), None),
        (
            _step_model(),
            _ensemble(model="gone"),
            "ensemble e contains models that are not available or ambiguous: gone",
        ),
        (
            _step_model(),
            _ensemble(input_name="Z"),
            "in ensemble e, ensemble tensor X is mapping to non-existing input Z in model m",
        ),
        (
            _step_model(rows=4),
            _ensemble(),
            "ensemble e allows maximum batch size 8, but it contains model m which only allows "
            "maximum batch size to be 4",
        ),
        (
            _step_model(datatype="INT32"),
            _ensemble(),
            "in ensemble e, ensemble tensor X: inconsistent data type: TYPE_FP32 is inferred "
            "from model e while TYPE_INT32 is inferred from model m",
        ),
        (
            _step_model(dims=(5,)),
            _ensemble(),
            "in ensemble e, ensemble tensor X: inconsistent shape: [-1,4] is inferred from "
            "model e while [-1,5] is inferred from model m",
        ),
    ],
)
def test_steps_checked_against_their_models(
    step: ModelConfig, ensemble: ModelConfig, message: str | None
) -> None:
    registry = ModelRegistry()
    _model(registry, step)
    model = _model(registry, ensemble, State.LOADING)
    names = {"m", "e"}
    assert check_ensemble(registry, model, names.__contains__) == message


def test_a_step_model_not_loaded_or_failed() -> None:
    registry = ModelRegistry()
    model = _model(registry, _ensemble(), State.LOADING)
    expected = "ensemble 'e' depends on 'm' which has no loaded version."
    assert check_ensemble(registry, model, {"m", "e"}.__contains__) == expected
    failed = _model(registry, _step_model(), State.FAILED)
    failed.error = "failed to load: broken"
    assert check_ensemble(registry, model, {"m", "e"}.__contains__) == (
        "ensemble 'e' depends on 'm' which has no loaded version. Model 'm' loading failed "
        "with error: failed to load: broken"
    )


def test_ensembles_containing_each_other() -> None:
    registry = ModelRegistry()
    outer = _model(registry, _ensemble("outer", model="inner"), State.LOADING)
    inner = _model(registry, _ensemble("inner", model="outer"), State.LOADING)
    assert load_order([outer, inner]) == [outer, inner]  # a cycle: any order
    assert check_ensemble(registry, outer, {"outer", "inner"}.__contains__) == (
        "circular dependency between ensembles: outer -> ... -> inner -> outer"
    )
    plain = ModelRegistry()
    first = _model(plain, _ensemble("first", model="second"), State.LOADING)
    second = _model(plain, _ensemble("second", model="m"), State.LOADING)
    assert load_order([first, second]) == [second, first]


def test_a_reload_that_would_close_a_cycle_is_refused_and_readiness_answers() -> None:
    """A served model reloaded as an ensemble over an ensemble that runs it: the check walks
    the candidate's steps, not those of the version it replaces; and were the two ever served
    together, readiness answers instead of recursing."""
    registry = ModelRegistry()
    _model(registry, _step_model().model_copy(update={"name": "b"}))
    outer = _model(registry, _ensemble("a", model="b"), State.LOADING)
    assert check_ensemble(registry, outer, {"a", "b"}.__contains__) is None
    assert settle(registry, outer, {"a", "b"}.__contains__)
    candidate = ServedModel(_ensemble("b", model="a"), Path("."), state=State.LOADING)
    assert check_ensemble(registry, candidate, {"a", "b"}.__contains__) == (
        "circular dependency between ensembles: b -> ... -> a -> b"
    )
    # Served together anyway (as a check before this one let through): not ready, no error.
    candidate.state = State.READY
    candidate.waiting_for = functools.partial(waiting_for, registry, candidate.config)
    registry.add(candidate)
    assert outer.ready is True
    assert registry.all_ready() is True


def test_step_models_of_a_deep_chain_each_once_steps_first() -> None:
    depth = 5000  # deeper than the interpreter's recursion limit
    configs = {f"e{i}": [_ensemble(f"e{i}", model=f"e{i + 1}")] for i in range(depth)}
    configs[f"e{depth}"] = [_step_model().model_copy(update={"name": f"e{depth}"})]
    ordered = composing(configs["e0"], {"e0"}, configs.get)
    assert ordered == [f"e{i}" for i in range(depth, 0, -1)]
    diamond = {
        "top": [_ensemble("top", model="left"), _ensemble("top", model="right")],
        "left": [_ensemble("left", model="right")],
        "right": [_ensemble("right", model="m")],
        "m": [_step_model()],
    }
    assert composing(diamond["top"], {"top"}, diamond.get) == ["m", "right", "left"]


def test_models_selected_at_start_up_bring_their_step_models() -> None:
    def source(config: ModelConfig) -> ModelSource:
        version = VersionSource(config.model_copy(update={"version": "1"}), Path("."), "")
        return ModelSource(config.name, Path("."), {"1": version})

    outer = _ensemble(name="outer", model="e")
    sources = {
        "outer": source(outer),
        "e": source(_ensemble()),
        "m": source(_step_model()),
        "other": source(_step_model().model_copy(update={"name": "other"})),
    }
    assert with_step_models(sources, {"outer"}.__contains__) == {"outer", "e", "m"}
    assert with_step_models(sources, {"m"}.__contains__) == {"m"}


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [({}, False), ({"unload_dependents": True}, True), ({"unload_dependents": False}, False)],
)
def test_unload_dependents_parameter(parameters: dict[str, object], expected: bool) -> None:
    assert unload_parameters(parameters) is expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"unload_dependents": "yes"}, "parameter 'unload_dependents' must be true or false"),
        ({"config": "{}"}, "unknown unload parameter 'config' (known: unload_dependents)"),
    ],
)
def test_unload_parameters_refused_by_name(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        unload_parameters(parameters)
