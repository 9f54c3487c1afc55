"""Engines as the handler's ``speed_path``: an artifact runs the forward on the batch ``collate``
made, and ``to_numpy`` takes its outputs, so a model's pre- and post-processing (its handler)
stay the same whatever engine runs in between."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nograd.runtime.engines.artifacts import ArtifactError
from nograd.runtime.handler import ModelHandler, SpeedPath


class EnginePath:
    """Common part: variable shapes (no padding beyond ``collate``'s), no row cap."""

    name = "engine"

    def __init__(self, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.weights_bytes = 0
        """The artifact's size: what its weights cost in memory, about (set by ``open_engine``)."""

    @property
    def max_rows(self) -> int | None:
        return None

    @property
    def sequence_inputs(self) -> frozenset[str]:
        return frozenset()

    @property
    def fixed_shapes(self) -> bool:
        return False

    def padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        return rows, length

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def plain(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Float tensors in fp32 and contiguous, as the artifact was traced: beside an eager
        speed mode (bf16 weights, channels-last) ``collate`` may have made them otherwise."""
        return {
            name: tensor.to(torch.float32).contiguous() if tensor.is_floating_point() else tensor
            for name, tensor in batch.items()
        }

    def check_inputs(self, handler: ModelHandler) -> None:
        """The artifact takes exactly the tensors the handler collates, or the load fails."""
        collated = sorted(handler.collate([handler.example(1, 8)]))
        if collated != sorted(self.inputs):
            raise ArtifactError(
                f"the artifact takes inputs {sorted(self.inputs)}, the model's handler "
                f"collates {collated}"
            )


class TorchProgramPath(EnginePath):
    """A ``torch.export`` program's module, or an AOTInductor package's compiled model: both
    take the collated tensors as one dict and give the outputs as a dict, by name."""

    def __init__(self, name: str, run: Callable[[dict[str, torch.Tensor]], Any]) -> None:
        super().__init__((), ())
        self.name = name
        self._run = run

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        result = self._run(self.plain(batch))
        if not isinstance(result, Mapping):
            raise ArtifactError(
                f"the {self.name} artifact returned {type(result).__name__}, not a dict of "
                "outputs by name (export it with nograd export)"
            )
        return result

    def check_inputs(self, handler: ModelHandler) -> None:
        """Checked by the program itself: its call spec names the dict's keys."""


class OnnxPath(EnginePath):
    """ONNX Runtime sessions, one per intra-op width: each batch runs on as many threads as torch
    has at that moment, the width the worker's core ledger granted when workers share the cores
    (an ONNX Runtime pool is fixed at its session's creation). On CUDA the inputs are bound where
    they lie (no host copy)."""

    def __init__(self, name: str, path: Path, device: torch.device) -> None:
        self.name = name
        self.path = path
        self.device = device
        self.spinning = True
        self._sessions: dict[int, Any] = {}
        session = self.session
        inputs = [value.name for value in session.get_inputs()]
        outputs = [value.name for value in session.get_outputs()]
        super().__init__(inputs, outputs)

    @property
    def session(self) -> Any:
        """The session for torch's current thread count, opened on first use."""
        threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        session = self._sessions.get(threads)
        if session is None:
            session = onnx_session(self.path, self.device, self.spinning, threads)
            self._sessions[threads] = session
        return session

    def stop_spinning(self, widths: Sequence[int] = ()) -> None:
        """Reopen the sessions with threads that sleep after a run (and open one per width in
        ``widths`` now, not under traffic): for a worker that also runs eager torch, or shares
        the cores with other workers, a spinning pool holds cores another batch needs."""
        self.spinning = False
        self._sessions.clear()
        for threads in widths:
            self._sessions[threads] = onnx_session(self.path, self.device, False, threads)
        _ = self.session

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        batch = self.plain(batch)
        if self.device.type == "cuda":
            return self._forward_bound(batch)
        feeds = {name: batch[name].numpy() for name in self.inputs}
        results = self.session.run(list(self.outputs), feeds)
        return {
            name: torch.from_numpy(np.asarray(value))
            for name, value in zip(self.outputs, results, strict=True)
        }

    def _forward_bound(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        binding = self.session.io_binding()
        index = self.device.index or 0
        tensors = {name: batch[name] for name in self.inputs}
        for name, tensor in tensors.items():
            binding.bind_input(
                name,
                "cuda",
                index,
                _numpy_dtype(tensor.dtype),
                list(tensor.shape),
                tensor.data_ptr(),
            )
        for name in self.outputs:
            binding.bind_output(name, "cuda", index)
        # The inputs were written on torch's stream; ONNX Runtime runs on its own.
        torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        results = binding.copy_outputs_to_cpu()
        return {
            name: torch.from_numpy(np.asarray(value))
            for name, value in zip(self.outputs, results, strict=True)
        }


def _numpy_dtype(dtype: torch.dtype) -> type:
    return type(torch.empty((), dtype=dtype).numpy().dtype.type(0))


class RangePath:
    """Several engines, each running the batches of a range of row counts it was timed fastest
    at; ``None`` runs the handler's own eager forward (with its speed mode's path, if any)."""

    def __init__(
        self,
        handler: ModelHandler,
        eager: SpeedPath | None,
        ranges: Sequence[tuple[int, EnginePath | None]],
    ) -> None:
        self._handler = handler
        self._eager = eager
        self.ranges = tuple(ranges)
        """(largest rows, engine) pairs, ascending; the last one takes every larger batch."""

    @property
    def max_rows(self) -> int | None:
        return None if self._eager is None else self._eager.max_rows

    @property
    def sequence_inputs(self) -> frozenset[str]:
        return frozenset() if self._eager is None else self._eager.sequence_inputs

    @property
    def fixed_shapes(self) -> bool:
        return self._eager is not None and self._eager.fixed_shapes

    def padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        return (rows, length) if self._eager is None else self._eager.padded_shape(rows, length)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        rows = next(iter(batch.values())).shape[0]
        engine = self.ranges[-1][1]
        for most, candidate in self.ranges:
            if rows <= most:
                engine = candidate
                break
        if engine is not None:
            return engine.forward(batch)
        if self._eager is not None:
            return self._eager.forward(batch)
        return self._handler.forward(batch)


def onnx_session(path: Path, device: torch.device, spinning: bool, threads: int) -> Any:
    """An ONNX Runtime session on ``device`` with ``threads`` intra-op threads (0: its default).

    ``spinning`` keeps its threads busy-waiting for a while after each run, as ONNX Runtime does
    by default: faster when it runs every batch, a tax on eager torch when the two take turns
    (docs/engines.md measures both).
    """
    try:
        import onnxruntime
    except ImportError as exc:
        raise ArtifactError(
            "the onnx engine needs ONNX Runtime: pip install 'nograd[onnx]'"
        ) from exc
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    allow = "1" if spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", allow)
    options.add_session_config_entry("session.inter_op.allow_spinning", allow)
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ArtifactError(
                "ONNX Runtime here has no CUDA provider; install onnxruntime-gpu for CUDA"
            )
        providers: list[Any] = [
            ("CUDAExecutionProvider", {"device_id": device.index or 0}),
            "CPUExecutionProvider",
        ]
    else:
        providers = ["CPUExecutionProvider"]
    return onnxruntime.InferenceSession(str(path), options, providers=providers)


def open_engine(engine: str, path: Path, device: torch.device) -> EnginePath:
    """Load ``engine``'s artifact at ``path`` onto ``device``."""
    opened: EnginePath
    if engine in ("onnx", "onnx-int8"):
        opened = OnnxPath(engine, path, device)
    elif engine == "torch_export":
        module = torch.export.load(str(path)).module()
        module.to(device)
        opened = TorchProgramPath(engine, module)
    elif engine == "aoti":
        index = (device.index or 0) if device.type == "cuda" else -1
        compiled = torch._inductor.aoti_load_package(str(path), device_index=index)
        opened = TorchProgramPath(engine, compiled)
    else:
        raise ArtifactError(f"unknown engine {engine!r}")
    opened.weights_bytes = path.stat().st_size
    return opened


def engine_weights_bytes(path: object) -> int:
    """The weights the engines of a handler's speed path hold (0 for eager's own paths)."""
    if isinstance(path, EnginePath):
        return path.weights_bytes
    if isinstance(path, RangePath):
        return sum(engine.weights_bytes for _, engine in path.ranges if engine is not None)
    return 0


def share_cores(path: object, widths: Sequence[int]) -> None:
    """The engines of a handler's speed path set up for a worker that shares the cores batch by
    batch: ONNX Runtime without spinning, a session ready for each width the ledger may grant."""
    engines = [path] if isinstance(path, EnginePath) else []
    if isinstance(path, RangePath):
        engines = [engine for _, engine in path.ranges if engine is not None]
    for engine in engines:
        if isinstance(engine, OnnxPath) and engine.device.type == "cpu":
            engine.stop_spinning(widths)
