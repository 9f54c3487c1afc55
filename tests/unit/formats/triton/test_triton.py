"""Triton model folders read into nograd's configs: Triton's own config.pbtxt files, the fields
mapped, the ones refused by name, version policies, and nograd's folders beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format

from nograd.formats.triton.reading.config import is_triton_folder, read_triton
from nograd.formats.triton.reading.generated import model_config_pb2
from nograd.schema.config import ConfigError
from nograd.serving.control.repository import read_model, scan
from tests.triton_models import FIXTURES, ROOT


def _folder(tmp_path: Path, name: str, config: str | None, model: str = "model.onnx") -> Path:
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    shutil.copy(FIXTURES / "simple" / "1" / "model.onnx", folder / "1" / model)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    return folder


def test_triton_s_simple_maps_onto_an_onnx_artifact_batched_by_8() -> None:
    config = read_triton(FIXTURES / "simple")
    assert (config.name, config.format, config.artifact) == ("simple", "onnx", "model.onnx")
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")
    assert config.batch_dimension is True and config.max_batch_size == 8
    assert [(s.name, s.datatype, s.shape) for s in config.inputs] == [
        ("INPUT0", "INT32", (16,)),
        ("INPUT1", "INT32", (16,)),
    ]
    assert config.version_policy.latest == 1
    assert config.max_queue_delay_ms == 0.0  # no dynamic_batching: no waiting for others


def test_the_configuration_reported_completes_as_triton_s_does() -> None:
    """Triton's QA lists what it completes cpu_instance's config.pbtxt to (``expected``)."""
    config = read_triton(FIXTURES / "cpu_instance")
    assert (config.format, config.artifact, config.device) == ("torchscript", "model.pt", "cpu")
    expected = model_config_pb2.ModelConfig()
    text_format.Parse((FIXTURES / "cpu_instance" / "expected").read_text(), expected)
    wanted = json_format.MessageToDict(expected, preserving_proto_field_name=True)
    assert config.triton_config is not None
    reported = json.loads(config.triton_config)
    for field in ("name", "platform", "backend", "max_batch_size", "default_model_filename"):
        assert reported[field] == wanted[field], field
    assert reported["version_policy"] == wanted["version_policy"]
    assert [i["dims"] for i in reported["input"]] == [[16], [16]]
    group = reported["instance_group"][0]
    assert (group["name"], group["kind"], group["count"]) == ("cpu_instance", "KIND_CPU", 1)


def test_dynamic_batching_and_version_policy_map(tmp_path: Path) -> None:
    text = (FIXTURES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"m"')
    text += """
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 1500
  default_queue_policy { max_queue_size: 7 } }
version_policy: { specific: { versions: [ 1, 3 ] } }
"""
    folder = _folder(tmp_path, "m", text)
    for version in ("2", "3"):
        shutil.copytree(folder / "1", folder / version)
    config = read_triton(folder)
    assert (config.max_queue_delay_ms, config.max_queue_size) == (1.5, 7)
    source = read_model(folder)
    assert source is not None and list(source.versions) == ["1", "3"]
    assert source.versions["3"].config.version == "3"


def test_max_batch_size_0_means_no_batch_dimension(tmp_path: Path) -> None:
    text = (FIXTURES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"m"')
    config = read_triton(_folder(tmp_path, "m", text.replace("max_batch_size: 8", "")))
    assert config.batch_dimension is False and config.max_batch_size == 1


def test_onnx_without_config_is_auto_completed_at_load(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "bare", None)
    assert is_triton_folder(folder)
    config = read_triton(folder)
    assert config.batch_dimension is None and not config.inputs
    assert config.format == "onnx"
    # ONNX Runtime's backend cannot tell a max_batch_size of 0 from none: it auto-completes both.
    (folder / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\nmax_batch_size: 0\n')
    assert read_triton(folder).batch_dimension is None


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda t: t.replace('name: "simple"', 'name: "other"'), "field 'name'"),
        (
            lambda t: t + "\nsequence_batching { iterative_sequence: true }\n",
            "'sequence_batching.iterative_sequence'",
        ),
        (lambda t: t + "\nensemble_scheduling { }\n", "cannot be set for model 'simple'"),
        (lambda t: t.replace("onnxruntime_onnx", "tensorrt_plan"), "'tensorrt_plan'"),
        (lambda t: t.replace("TYPE_INT32", "TYPE_BF16", 1), "TYPE_BF16"),
        (
            lambda t: t.replace("dims: [ 16 ]", "dims: [ 16 ]\n optional: true", 1),
            "'optional' inputs are served by nograd's python backend only: its onnxruntime",
        ),
        (lambda t: t + "\nmodel_transaction_policy { decoupled: true }\n", "transaction"),
        (lambda t: t + "\nnot_a_field: 1\n", "cannot parse"),
    ],
)
def test_unsupported_fields_are_load_errors_naming_them(
    tmp_path: Path, edit: object, named: str
) -> None:
    text = (FIXTURES / "simple" / "config.pbtxt").read_text()
    folder = _folder(tmp_path, "simple", edit(text))  # type: ignore[operator]
    with pytest.raises(ConfigError, match=named):
        read_triton(folder)


def test_python_backend_read_with_its_strings() -> None:
    identity = read_triton(FIXTURES / "simple_identity")
    assert (identity.platform, identity.backend, identity.format) == ("python", "python", "python")
    assert (identity.module, identity.artifact) == ("model.py", None)
    assert identity.inputs[0].datatype == "BYTES" and identity.max_batch_size == 8
    add_sub = read_triton(FIXTURES / "add_sub")
    assert add_sub.batch_dimension is False
    assert json.loads(add_sub.triton_config or "")["platform"] == ""
    # Strings through ONNX Runtime are served (numpy arrays, no torch); through TorchScript
    # (torch in between) they are refused, naming the type.
    strings = read_triton(FIXTURES / "simple_string")
    assert strings.format == "onnx" and strings.outputs[0].datatype == "BYTES"


def test_strings_through_torchscript_refused_naming_the_type(tmp_path: Path) -> None:
    text = (FIXTURES / "simple_string" / "config.pbtxt").read_text()
    text = text.replace('"simple_string"', '"s"').replace("onnxruntime_onnx", "pytorch_libtorch")
    with pytest.raises(ConfigError, match="TYPE_STRING is not served by nograd's pytorch"):
        read_triton(_folder(tmp_path, "s", text, model="model.pt"))


def test_a_python_model_without_config_is_a_triton_folder(tmp_path: Path) -> None:
    """As Triton's auto-complete finds it: ``model.py`` in a version folder is the Python
    backend; its tensors and batch size come from its ``auto_complete_config`` at load."""
    folder = tmp_path / "bare_python" / "1"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text("class TritonPythonModel: ...\n")
    assert is_triton_folder(tmp_path / "bare_python")
    config = read_triton(tmp_path / "bare_python")
    assert (config.backend, config.format, config.module) == ("python", "python", "model.py")
    assert (config.inputs, config.outputs, config.batch_dimension) == ((), (), False)
    document = json.loads(config.triton_config or "")
    assert (document["name"], document["platform"]) == ("bare_python", "")
    assert document["default_model_filename"] == "model.py"
    # A folder with no model file in a version folder is still no model.
    (folder / "model.py").rename(folder / "notes.txt")
    assert not is_triton_folder(tmp_path / "bare_python")


def test_ignored_fields_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = (FIXTURES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"warned"')
    text += '\nmodel_warmup [ { name: "w" batch_size: 1 } ]\nresponse_cache { enable: true }\n'
    text += 'parameters { key: "k" value: { string_value: "v" } }\n'
    with caplog.at_level("WARNING"):
        read_triton(_folder(tmp_path, "warned", text))
    logged = caplog.text
    assert "response_cache" in logged and "'parameters'" in logged
    assert "model_warmup" not in logged  # run at load (nograd/formats/triton/running/warmup.py)


def test_triton_and_nograd_folders_side_by_side(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "simple", tmp_path / "simple")
    shutil.copytree(ROOT / "models" / "digits", tmp_path / "digits")
    _folder(tmp_path, "bare", None)
    found, problems = scan(tmp_path)
    assert problems == []
    assert sorted(found) == ["bare", "digits", "simple"]
    assert found["digits"].versions["1"].config.backend == "nograd"


def test_the_engine_parameter_opts_torchscript_in_and_is_refused_elsewhere(
    tmp_path: Path,
) -> None:
    parameter = '\nparameters { key: "nograd_engine" value: { string_value: "%s" } }\n'
    text = (FIXTURES / "cpu_instance" / "config.pbtxt").read_text()
    chosen = read_triton(_folder(tmp_path, "cpu_instance", text + parameter % "auto", "model.pt"))
    assert (chosen.format, chosen.engine) == ("torchscript", "auto")
    with pytest.raises(ConfigError, match="'nograd_engine': 'fast' is not one of"):
        read_triton(
            _folder(tmp_path / "bad", "cpu_instance", text + parameter % "fast", "model.pt")
        )
    simple = (FIXTURES / "simple" / "config.pbtxt").read_text() + parameter % "auto"
    with pytest.raises(ConfigError, match="only a TorchScript model"):
        read_triton(_folder(tmp_path, "simple", simple))


def test_an_output_s_labels_file_is_read_and_a_missing_one_named(tmp_path: Path) -> None:
    text = (FIXTURES / "simple" / "config.pbtxt").read_text().replace('"simple"', '"m"')
    labelled = text.replace('name: "OUTPUT1"', 'name: "OUTPUT1"\n    label_filename: "l.txt"')
    folder = _folder(tmp_path, "m", labelled)
    (folder / "l.txt").write_text("cat\ndog\n")
    config = read_triton(folder)
    assert [spec.labels for spec in config.outputs] == [(), ("cat", "dog")]
    (folder / "l.txt").unlink()
    with pytest.raises(ConfigError, match=r"'label_filename' 'l\.txt' is not a file in the model"):
        read_triton(folder)
    escaping = labelled.replace('"l.txt"', '"../l.txt"')
    (tmp_path / "l.txt").write_text("x\n")
    with pytest.raises(ConfigError, match="is not a file in the model folder"):
        read_triton(_folder(tmp_path, "n", escaping.replace('"m"', '"n"')))
