"""Triton ensembles read from their config.pbtxt: the steps, and the refusals Triton makes when
it reads the config (its own words): a step without a model or maps, a tensor written twice, an
output nothing computes (a cycle), a tensor nothing uses, fields an ensemble may not set."""

from __future__ import annotations

from pathlib import Path

import pytest

from nograd.formats.triton.reading.config import read_triton
from nograd.schema.config import ConfigError
from tests.triton_models import CHAIN_CONFIG, FIXTURES

TWO_STEPS = """
name: "pair"
platform: "ensemble"
max_batch_size: 4
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 2 ] }} ]
{extra}
ensemble_scheduling {{
  step [
    {{ model_name: "m" model_version: -1 input_map {{ key: "X" value: "{first_in}" }}
       output_map {{ key: "Y" value: "{first_out}" }} }},
    {{ model_name: "m" model_version: 2 input_map {{ key: "X" value: "{second_in}" }}
       output_map {{ key: "Y" value: "{second_out}" }} }}
  ]
}}
"""


def _pair(tmp_path: Path, extra: str = "", **maps: str) -> Path:
    names = {"first_in": "X", "first_out": "mid", "second_in": "mid", "second_out": "Y"}
    folder = tmp_path / "pair"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(TWO_STEPS.format(extra=extra, **{**names, **maps}))
    return folder


def test_python_backend_s_ensemble_read_as_triton_ships_it() -> None:
    config = read_triton(FIXTURES / "ensemble_python_resnet50")
    assert (config.format, config.platform, config.backend) == ("ensemble", "ensemble", "")
    assert config.batch_dimension is True and config.max_batch_size == 256
    assert [(s.model, s.version, s.inputs, s.outputs) for s in config.steps] == [
        ("preprocess", None, (("INPUT_0", "INPUT"),), (("OUTPUT_0", "preprocessed_image"),)),
        ("resnet50_trt", None, (("input", "preprocessed_image"),), (("output", "OUTPUT"),)),
    ]


def test_pinned_version_and_no_batch_dimension(tmp_path: Path) -> None:
    steps = read_triton(_pair(tmp_path)).steps
    assert [s.version for s in steps] == [None, "2"]
    folder = tmp_path / "chain"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(CHAIN_CONFIG)
    chain = read_triton(folder)
    assert chain.batch_dimension is False and len(chain.steps) == 3


@pytest.mark.parametrize(
    ("maps", "message"),
    [
        (
            {"first_in": "X", "first_out": "mid", "second_in": "mid", "second_out": "mid"},
            "ensemble tensor 'mid' can appear in an output map only once for ensemble 'pair' "
            "step 1",
        ),
        (
            {"second_in": "X", "first_out": "spare"},
            "ensemble tensor 'spare' is unused in ensemble 'pair'",
        ),
        (
            {"first_in": "Z", "second_in": "Z"},
            "ensemble input 'X' for ensemble pair' is not used",
        ),
        (
            {"first_in": "X", "first_out": "mid", "second_in": "other"},
            "output 'Y' for ensemble 'pair' is not written: at least one of its depending "
            "tensors, 'other', is not connected",
        ),
    ],
)
def test_data_flow_refused_in_triton_s_words(
    tmp_path: Path, maps: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        read_triton(_pair(tmp_path, **maps))
    assert str(raised.value).endswith(message)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("instance_group [ { kind: KIND_CPU } ]", "instance group should not be specified"),
        ("optimization { }", "optimization should not be specified for ensemble 'pair'"),
        (
            'model_warmup [ { name: "w" batch_size: 1 } ]',
            "model_warmup can not be specified for ensemble 'pair'",
        ),
    ],
)
def test_fields_an_ensemble_may_not_set(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_triton(_pair(tmp_path, extra))


CYCLE = """
platform: "ensemble"
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
ensemble_scheduling {
  step [
    { model_name: "m" model_version: -1 input_map { key: "A" value: "X" }
      input_map { key: "B" value: "loop" } output_map { key: "C" value: "mid" } },
    { model_name: "n" model_version: -1 input_map { key: "A" value: "mid" }
      output_map { key: "C" value: "loop" } output_map { key: "D" value: "Y" } }
  ]
}
"""


def test_a_cycle_leaves_the_output_unwritten(tmp_path: Path) -> None:
    folder = tmp_path / "cycle"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(CYCLE)
    with pytest.raises(ConfigError) as raised:
        read_triton(folder)
    assert str(raised.value).endswith(
        "output 'Y' for ensemble 'cycle' is not written: at least one of its depending tensors, "
        "'loop', is not connected"
    )


def test_an_ensemble_without_steps_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('platform: "ensemble"\n')
    with pytest.raises(ConfigError, match="ensemble scheduling must be set for ensemble empty"):
        read_triton(folder)
