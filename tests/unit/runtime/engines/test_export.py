"""``nograd export`` and the artifact formats: each format round-trips for digits and minilm
(export, load the written folder as the server does, same answers as eager within the guard)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nograd.cli import export_command
from nograd.runtime.engines.export import ExportError, export_model
from nograd.runtime.handler import ModelHandler, TorchRunner
from nograd.runtime.loader import LoadError, build_handler
from nograd.schema.config import find_config, load_config
from tests.shipped_exports import shipped_export
from tests.unit.runtime.engines.tiny import tiny_folder

ROOT = Path(__file__).resolve().parents[4]
CPU = torch.device("cpu")
TEXTS = [b"A man is eating food.", b"nograd serves models", b"short", b"x " * 300]


def load(folder: Path) -> ModelHandler:
    path = find_config(folder)
    assert path is not None
    return build_handler(folder.parent, folder, load_config(path), CPU)


def digits_outputs(handler: ModelHandler) -> dict[str, np.ndarray]:
    images = np.arange(5 * 64, dtype=np.float32).reshape(5, 1, 8, 8) % 17
    parts = [handler.prepare({"image": images[:2]}), handler.prepare({"image": images[2:]})]
    outs = TorchRunner(handler).run_batch(parts)
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


def minilm_outputs(handler: ModelHandler) -> dict[str, np.ndarray]:
    parts = [handler.prepare({"text": np.array([text], dtype=object)}) for text in TEXTS]
    outs = TorchRunner(handler).run_batch(parts)
    return {name: np.concatenate([o[name] for o in outs]) for name in outs[0]}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name in ("digits", "minilm"):
        shutil.copytree(ROOT / "models" / name, root / name)
    return root


@pytest.fixture(scope="module")
def eager_digits(repository: Path) -> dict[str, np.ndarray]:
    """digits' answers on eager torch, every format's reference."""
    return digits_outputs(load(repository / "digits"))


@pytest.fixture(scope="module")
def eager_minilm(repository: Path) -> dict[str, np.ndarray]:
    """minilm's answers on eager torch: loaded once, each load costs seconds."""
    return minilm_outputs(load(repository / "minilm"))


@pytest.mark.parametrize("to", ["onnx", "torch_export", "aoti", "torchscript"])
def test_digits_round_trips_through_each_format(
    eager_digits: dict[str, np.ndarray], to: str
) -> None:
    """Exported once per run (``tests/shipped_exports.py``): the end-to-end tests serve the same
    folders."""
    folder = shipped_export("digits", to)
    served = load(folder)
    assert served.speed_mode == to
    assert served.config.format == to
    expected = eager_digits
    got = digits_outputs(served)
    np.testing.assert_allclose(got["logits"], expected["logits"], atol=1e-4)
    np.testing.assert_array_equal(got["label"], expected["label"])


@pytest.mark.parametrize("to", ["onnx", "torch_export", "torchscript"])
def test_minilm_round_trips_with_its_tokenizer_kept(
    eager_minilm: dict[str, np.ndarray], to: str
) -> None:
    folder = shipped_export("minilm", to)
    assert (folder / "model.py").is_file()  # the tokenizer and naming hooks
    served = load(folder)
    # The artifact holds the weights; the handler loaded none of its own.
    assert served.module is None and served.weights_bytes == 0
    expected = eager_minilm
    got = minilm_outputs(served)
    np.testing.assert_allclose(got["embedding"], expected["embedding"], atol=1e-5)
    np.testing.assert_array_equal(got["token_count"], expected["token_count"])


def test_int8_export_is_checked_on_cosine(repository: Path) -> None:
    done = export_model(repository / "digits", "onnx", precision="int8")
    assert done.folder.name == "digits-onnx-int8"
    assert done.accuracy.min_cosine > 0.99
    assert (
        done.artifact.stat().st_size
        < 0.6 * (repository / "digits/model.safetensors").stat().st_size
    )


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model exported to ONNX once for the module; a test that changes it copies it."""
    root = tmp_path_factory.mktemp("tiny")
    return export_model(tiny_folder(root), "onnx", out=root / "tiny-onnx").folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def test_an_artifact_names_its_own_inputs_and_outputs(tiny_onnx: Path, tmp_path: Path) -> None:
    exported = export_model(tiny_folder(tmp_path), "torch_export", out=tmp_path / "bare-export")
    for folder in (copy_of(tiny_onnx, tmp_path), exported.folder):
        config = (folder / "config.yaml").read_text()
        head, _, _ = config.partition("inputs:")
        (folder / "config.yaml").write_text(head)
        served = load(folder)
        assert [(s.name, s.datatype, s.shape) for s in served.config.inputs] == [
            ("x", "FP32", (16,))
        ]
        assert [(s.name, s.datatype, s.shape) for s in served.config.outputs] == [
            ("scores", "FP32", (4,)),
            ("label", "INT64", (1,)),
        ]


def test_a_changed_artifact_fails_its_sha256(tiny_onnx: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_onnx, tmp_path)
    with (folder / "model.onnx").open("ab") as stream:
        stream.write(b"\0")
    with pytest.raises(LoadError, match="does not match artifact_sha256"):
        load(folder)


def test_an_artifact_that_is_not_one_fails_the_load_naming_it(
    tiny_onnx: Path, tmp_path: Path
) -> None:
    folder = copy_of(tiny_onnx, tmp_path)
    (folder / "model.onnx").write_bytes(b"not an onnx model")
    config = folder / "config.yaml"
    config.write_text(
        "\n".join(line for line in config.read_text().splitlines() if "sha256" not in line)
    )
    with pytest.raises(LoadError, match=r"model\.onnx: cannot load the onnx artifact"):
        load(folder)


def test_export_refuses_what_it_cannot_do(tiny_onnx: Path, tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    with pytest.raises(ExportError, match="int8 is for --to onnx"):
        export_model(folder, "aoti", precision="int8")
    with pytest.raises(ExportError, match="no config file"):
        export_model(tmp_path, "onnx")
    with pytest.raises(ExportError, match="already a onnx artifact"):
        export_model(tiny_onnx, "onnx")


def test_the_export_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny_folder(tmp_path)
    assert export_command([str(folder), "--to", "onnx", "--out", str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert export_command([str(tmp_path / "nowhere"), "--to", "onnx"]) == 1
    assert "no config file" in capsys.readouterr().err


def test_the_export_command_writes_torchscript_as_triton_s_pytorch_backend_runs_it(
    tmp_path: Path,
) -> None:
    """``--to torchscript``: a ``model.pt`` that ``torch.jit.load`` runs alone (positional
    inputs, a tuple of outputs in the config's order) and a config of format torchscript."""
    folder = tiny_folder(tmp_path)
    out = tmp_path / "tiny-torchscript"
    assert export_command([str(folder), "--to", "torchscript", "--out", str(out)]) == 0
    config = load_config(out / "config.yaml")
    assert (config.format, config.artifact) == ("torchscript", "model.pt")
    assert [spec.name for spec in config.outputs] == ["scores", "label"]
    eager = load(folder)
    x = np.random.default_rng(3).random((5, 16), dtype=np.float32)
    expected = TorchRunner(eager).run_batch([eager.prepare({"x": x})])[0]
    scripted = torch.jit.load(str(out / "model.pt"))
    scores, label = scripted(torch.from_numpy(x))
    np.testing.assert_allclose(scores.numpy(), expected["scores"], atol=1e-5)
    np.testing.assert_array_equal(label.numpy(), expected["label"])
    served = load(out)
    assert served.speed_mode == "torchscript"
    got = TorchRunner(served).run_batch([served.prepare({"x": x})])[0]
    np.testing.assert_allclose(got["scores"], expected["scores"], atol=1e-5)


@pytest.mark.slow
def test_minilm_round_trips_through_aoti(
    repository: Path, eager_minilm: dict[str, np.ndarray]
) -> None:
    """AOTInductor compiles minilm in minutes on 2 cores: make test-slow runs it."""
    done = export_model(repository / "minilm", "aoti")
    expected = eager_minilm
    got = minilm_outputs(load(done.folder))
    np.testing.assert_allclose(got["embedding"], expected["embedding"], atol=1e-5)
