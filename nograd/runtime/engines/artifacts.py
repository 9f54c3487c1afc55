"""Writing engine artifacts (a torch.export program, an AOTInductor package, an ONNX model, its
int8 form) and finding them again: checksums and the build cache.

Every writer writes beside its target and renames, so a reader never opens half a file and two
workers building the same artifact at once both leave a whole one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

import torch

from nograd.runtime.engines.trace import Traced

ONNX_OPSET: Final = 18
SUFFIXES: Final = {"torch_export": ".pt2", "aoti": ".pt2", "onnx": ".onnx", "onnx-int8": ".onnx"}
"""File suffix of each engine's artifact; ``onnx-int8`` is the ONNX model, quantised."""
INT8_OPS: Final = ("MatMul", "Gemm")
"""Operators int8 quantises: the matrix multiplies, where the time goes in transformers and
classifier heads. Convolutions stay fp32 (ONNX Runtime's int8 convolution is slower on CPU)."""
_CHUNK: Final = 1 << 20


class ArtifactError(Exception):
    """An artifact that cannot be built or used; the message names the file."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str | None) -> None:
    """Refuse ``path`` unless its SHA-256 is ``expected`` (nothing to check when None)."""
    if expected is None:
        return
    actual = sha256_of(path)
    if actual != expected.lower():
        raise ArtifactError(
            f"{path}: SHA-256 {actual} does not match artifact_sha256 {expected.lower()}"
        )


def replace_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` on a temporary file beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.stem}.", suffix=f".tmp{target.suffix}"
    )
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def write_artifact(engine: str, traced: Traced, target: Path) -> Path:
    """Build ``engine``'s artifact from ``traced`` into ``target``."""
    writers: dict[str, Callable[[Path], None]] = {
        "torch_export": lambda path: torch.export.save(traced.program, str(path)),
        "aoti": lambda path: _write_aoti(traced, path),
        "onnx": lambda path: _write_onnx(traced, path),
        "onnx-int8": lambda path: _write_int8(traced, path),
    }
    if engine not in writers:
        raise ArtifactError(f"no artifact for engine {engine!r}")
    return replace_atomically(target, writers[engine])


def _write_aoti(traced: Traced, path: Path) -> None:
    # AOTInductor compiles the program to a shared library (C++ and the system compiler),
    # keeping the batch dimension symbolic; the package holds the library and the weights.
    package = torch._inductor.aoti_compile_and_package(traced.program, package_path=str(path))
    if Path(package) != path:
        os.replace(package, path)


def _write_onnx(traced: Traced, path: Path) -> None:
    import onnx

    exported = torch.onnx.export(
        traced.program,
        (traced.example,),
        input_names=list(traced.inputs),
        dynamo=True,
        external_data=False,
        opset_version=ONNX_OPSET,
        verbose=False,
    )
    if exported is None:
        raise ArtifactError("torch.onnx.export returned no program")
    model = exported.model_proto
    _name_outputs(model.graph, traced.outputs)
    onnx.save_model(model, str(path))


def _write_int8(traced: Traced, path: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        fp32 = Path(folder) / "fp32.onnx"
        _write_onnx(traced, fp32)
        # Per-channel weight scales keep the error of narrow output rows down; reduce_range (7-bit
        # weights) avoids the overflow of u8 x s8 products on CPUs without VNNI.
        quantize_dynamic(
            fp32,
            path,
            per_channel=True,
            reduce_range=True,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=list(INT8_OPS),
        )


def _name_outputs(graph: object, names: Iterable[str]) -> None:
    """Give the graph's outputs the model's output names, renaming any inner value that already
    has one of them (the exporter names values after the ops that make them: ``embedding``)."""
    outputs = list(graph.output)  # type: ignore[attr-defined]
    wanted: dict[str, str] = dict(zip((str(v.name) for v in outputs), names, strict=True))
    taken = set(wanted.values()) - set(wanted)

    def rename(old: str) -> str:
        if old in wanted:
            return wanted[old]
        return f"{old}__inner" if old in taken else old

    for node in graph.node:  # type: ignore[attr-defined]
        node.input[:] = [rename(name) for name in node.input]
        node.output[:] = [rename(name) for name in node.output]
    for value in [*graph.input, *graph.value_info, *outputs]:  # type: ignore[attr-defined]
        value.name = rename(value.name)
    for tensor in graph.initializer:  # type: ignore[attr-defined]
        tensor.name = rename(tensor.name)


def cache_key(engine: str, traced: Traced, code: Iterable[Path], device: torch.device) -> str:
    """What the artifact depends on: the engine, the library versions, the device type, the
    model's code files and its weights (hashed by value), and the traced signature."""
    digest = hashlib.sha256()
    for part in (engine, torch.__version__, _onnxruntime_version(), device.type):
        digest.update(part.encode() + b"\0")
    digest.update(repr((traced.inputs, traced.outputs)).encode())
    for name, example in traced.example.items():
        digest.update(repr((name, example.dtype, tuple(example.shape[1:]))).encode())
    for path in code:
        digest.update(path.read_bytes() if path.is_file() else b"")
    tensors = {**traced.program.state_dict, **traced.program.constants}
    for name in sorted(tensors):
        tensor = tensors[name]
        if isinstance(tensor, torch.Tensor):
            digest.update(name.encode() + _tensor_bytes(tensor))
    return digest.hexdigest()[:24]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def cached(
    cache_dir: Path, label: str, engine: str, key: str, build: Callable[[Path], Path]
) -> Path:
    """The artifact ``label`` + ``engine`` + ``key`` in ``cache_dir``, built first if missing.

    Builders take a lock file beside it, so workers starting together build it once: the others
    wait, then find it built.
    """
    target = cache_dir / f"{label}-{engine}-{key}{SUFFIXES[engine]}"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / f".{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        return build(target)


def _onnxruntime_version() -> str:
    try:
        import onnxruntime
    except ImportError:
        return "none"
    return str(onnxruntime.__version__)
