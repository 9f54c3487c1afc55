"""Peer: Triton Inference Server through PyTriton, with Triton's dynamic batcher.

Run with the PyTriton venv's python (``bench/peers/envs.py``). PyTriton starts a real
``tritonserver`` (HTTP/REST with the KServe V2 protocol, gRPC, metrics) whose Python backend hands
each batch to the callable bound here, in this process. The model answers with nograd's input and
output names, so the V2 bodies of ``bench/workloads.py`` are posted unchanged to
``/v2/models/<model>/infer``:

- ``minilm``: input ``text`` (BYTES, one sentence per row), outputs ``embedding`` ([384] FP32,
  mean-pooled, L2-normalised) and ``token_count`` ([1] INT64);
- ``digits``: input ``image`` ([1, 8, 8] FP32), outputs ``logits``, ``probabilities`` ([10]
  FP32) and ``label`` ([1] INT64).

Triton's ``max_batch_size`` and ``max_queue_delay_microseconds`` are options, so the bench can
try several. Every endpoint binds 127.0.0.1; gRPC takes ``--grpc-port`` (the bench drives it with
perf_analyzer) or a free port, metrics a free port. PyTriton puts Triton's statistics behind a
token by default; they are left open here, as a plain ``tritonserver`` serves them, because
perf_analyzer reads them around every measurement (its other restrictions stay).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import numpy as np


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _peer_models() -> ModuleType:
    """``peer_models.py`` beside this file, by path: the bench package is not installed here."""
    path = Path(__file__).with_name("peer_models.py")
    spec = importlib.util.spec_from_file_location("peer_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _libpython_on_library_path() -> None:
    """Triton's Python backend stub loads libpython; it is found only through the loader path
    when the interpreter lives outside the system's library folders (pyenv, venvs)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else str(libdir)


def _minilm_callable(model_dir: Path) -> Callable[..., dict[str, np.ndarray]]:
    from pytriton.decorators import batch  # type: ignore[import-not-found]

    peer_models = _peer_models()
    model = peer_models.MiniLMModel(model_dir)

    @batch  # type: ignore[untyped-decorator]
    def infer(text: np.ndarray) -> dict[str, np.ndarray]:
        embedding, counts = model.encode(peer_models.texts_of(text))
        return {"embedding": embedding, "token_count": counts}

    return infer  # type: ignore[no-any-return]


def _digits_callable() -> Callable[..., dict[str, np.ndarray]]:
    from pytriton.decorators import batch

    model = _peer_models().DigitsModel()

    @batch  # type: ignore[untyped-decorator]
    def infer(image: np.ndarray) -> dict[str, np.ndarray]:
        outputs: dict[str, np.ndarray] = model.predict(image)
        return outputs

    return infer  # type: ignore[no-any-return]


def _tensors(model: str) -> tuple[list[Any], list[Any]]:
    from pytriton.model_config import Tensor  # type: ignore[import-not-found]

    if model == "minilm":
        inputs = [Tensor(name="text", dtype=bytes, shape=(1,))]
        outputs = [
            Tensor(name="embedding", dtype=np.float32, shape=(384,)),
            Tensor(name="token_count", dtype=np.int64, shape=(1,)),
        ]
    else:
        inputs = [Tensor(name="image", dtype=np.float32, shape=(1, 8, 8))]
        outputs = [
            Tensor(name="logits", dtype=np.float32, shape=(10,)),
            Tensor(name="probabilities", dtype=np.float32, shape=(10,)),
            Tensor(name="label", dtype=np.int64, shape=(1,)),
        ]
    return inputs, outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("digits", "minilm"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--model-dir", type=Path, help="minilm: the HF-style model folder")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue-delay-us", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.model == "minilm" and args.model_dir is None:
        parser.error("--model-dir is required for minilm")
    _libpython_on_library_path()
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import (  # type: ignore[import-not-found]
        DEFAULT_PROTECTED_ENDPOINTS,
        Triton,
        TritonConfig,
        TritonSecurityConfig,
    )

    infer = _minilm_callable(args.model_dir) if args.model == "minilm" else _digits_callable()
    inputs, outputs = _tensors(args.model)
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port or _free_port(),
        metrics_address="127.0.0.1",
        metrics_port=_free_port(),
        log_verbose=0,
    )
    batching = ModelConfig(
        max_batch_size=args.max_batch_size,
        batcher=DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us),
    )
    # SIGTERM (the bench's stop) unwinds through the context manager: Triton stops and its
    # workspace (a copy of the server, sockets, the generated model) is removed.
    signal.signal(signal.SIGTERM, _stop_on_signal)
    folder = Path(tempfile.mkdtemp(prefix="nograd-pytriton-"))
    try:
        # PyTriton creates the workspace folder itself and refuses one that exists.
        restricted = [name for name in DEFAULT_PROTECTED_ENDPOINTS if name != "statistics"]
        security = TritonSecurityConfig(restricted_endpoints=restricted)
        with Triton(
            config=config, workspace=folder / "workspace", security_config=security
        ) as triton:
            triton.bind(
                model_name=args.model,
                infer_func=infer,
                inputs=inputs,
                outputs=outputs,
                config=batching,
                strict=False,
            )
            print(f"pytriton serving {args.model} on 127.0.0.1:{args.port}", file=sys.stderr)
            triton.serve()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
