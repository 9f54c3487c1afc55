"""ONNX Runtime: the forward exported to ONNX (and its int8 form), run by ONNX Runtime sessions.

ONNX Runtime allocates through its own arenas and per-thread scratch, which no torch counter
sees, so its memory is measured as what it is: the process's resident peak on CPU, the device's
free memory around the forward on CUDA, with the session reopened before each measured run so it
starts holding nothing. On CPU every run hands its arena's growth back when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch

from nograd.core.datatypes import NUMPY_DTYPES, TABLE
from nograd.core.engines import EngineRow, engine_row
from nograd.host.heap import AfterRuns, release_free_memory
from nograd.runtime.engines.errors import ArtifactError
from nograd.runtime.engines.onnx_mapped import mapped_session
from nograd.runtime.engines.paths import EnginePath
from nograd.runtime.engines.signature import tensor_spec
from nograd.runtime.memory import DeviceFreeProbe, MemoryProbe, ProcessPeakProbe

if TYPE_CHECKING:
    from nograd.runtime.engines.trace import Traced
    from nograd.schema.config import TensorSpec

logger = logging.getLogger(__name__)

ONNX_OPSET: Final = 18
INT8_OPS: Final = ("MatMul", "Gemm")
"""Operators int8 quantises: the matrix multiplies, where the time goes in transformers and
classifier heads. Convolutions stay fp32 (ONNX Runtime's int8 convolution is slower on CPU)."""
ONNX_DATATYPES: Final = {
    **{row.onnx: row.name for row in TABLE if row.onnx is not None},
    "tensor(string)": "BYTES",
}
"""ONNX's tensor types to the protocol's datatypes; strings are BYTES, run on numpy object arrays
of ``str`` (``nograd/runtime/string_tensors.py``), never through torch."""
ALONE_READING_BYTES: Final = 4 << 20
"""A fresh session's run reading at least this is taken alone: its allocations repeat exactly,
and the noise of a resident reading (pages other threads touch) is a small part of it."""
NO_CUDA_PROVIDER: Final = "ONNX Runtime here has no CUDA provider; install onnxruntime-gpu for CUDA"
_OUT_OF_MEMORY: Final = ("Failed to allocate memory", "out of memory", "bad_alloc")
"""Fragments of ONNX Runtime's messages when an allocation fails (CPU heap, CUDA arena)."""


@dataclass(frozen=True)
class OnnxEngine:
    """ONNX Runtime's engine; ``quantised``: the int8 variant (dynamic quantisation, CPU)."""

    row: EngineRow
    quantised: bool = False

    def unsupported(self, device: torch.device) -> str | None:
        """Said before anything is built: exporting a model only to find that ONNX Runtime
        cannot run it on the device costs every start seconds of export."""
        if self.quantised and device.type != "cpu":
            return "int8 runs on CPU only (ONNX Runtime's int8 kernels are CPU kernels)"
        if device.type == "cuda" and not _has_cuda_provider():
            return NO_CUDA_PROVIDER
        return None

    def build(self, traced: Traced, target: Path) -> None:
        if not self.quantised:
            _write_onnx(traced, target)
            return
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            fp32 = Path(folder) / "fp32.onnx"
            _write_onnx(traced, fp32)
            # Per-channel weight scales keep the error of narrow output rows down; reduce_range
            # (7-bit weights) avoids the overflow of u8 x s8 products on CPUs without VNNI.
            quantize_dynamic(
                fp32,
                target,
                per_channel=True,
                reduce_range=True,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=list(INT8_OPS),
            )

    def open(self, path: Path, device: torch.device) -> EnginePath:
        return OnnxPath(self.row.name, path, device)

    def signature(self, path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        inputs, outputs = onnx_tensors(path)

        def specs(values: list[OnnxTensor]) -> tuple[TensorSpec, ...]:
            return tuple(
                tensor_spec(path, name, datatype, shape) for name, datatype, shape in values
            )

        return specs(inputs), specs(outputs)


OnnxTensor = tuple[str, str | None, list[int | None]]
"""An ONNX graph's input or output: name, datatype (None: one nograd does not serve), shape
with None for each variable dimension, batch dimension included."""


def onnx_tensors(path: Path) -> tuple[list[OnnxTensor], list[OnnxTensor]]:
    """The inputs and outputs of the ONNX model at ``path`` as ONNX Runtime reads them (from
    its mapped form when weights are mapped here: reading them costs no copy of the weights)."""
    import onnxruntime

    providers: list[Any] = ["CPUExecutionProvider"]
    session = mapped_session(path, "cpu", onnxruntime.SessionOptions(), providers)
    if session is None:
        session = onnxruntime.InferenceSession(str(path), providers=providers)

    def tensors(values: list[Any]) -> list[OnnxTensor]:
        return [
            (
                v.name,
                ONNX_DATATYPES.get(v.type),
                [dim if isinstance(dim, int) and dim > 0 else None for dim in v.shape],
            )
            for v in values
        ]

    return tensors(session.get_inputs()), tensors(session.get_outputs())


ONNX: Final = OnnxEngine(engine_row("onnx"))
ONNX_INT8: Final = OnnxEngine(engine_row("onnx-int8"), quantised=True)


_spinning = True
"""Whether CPU sessions opened from now on keep their threads busy-waiting after a run
(``spin_after_runs``)."""


def spin_after_runs(enabled: bool) -> None:
    """From now on, CPU sessions open with threads that busy-wait for a while after each run, as
    ONNX Runtime does by default (the next batch starts sooner), or that sleep at once. The spin
    pays only in a process alone with the models it started with: beside fronts it takes the
    cores they decode on, beside other workers the cores the ledger grants their batches, with
    models loaded on demand the cores the loads, the other models' runs and a fleet's other
    replicas on the host need. Set before a session opens, so none opens twice."""
    global _spinning
    _spinning = enabled


class OnnxPath(EnginePath):
    """ONNX Runtime sessions, one per intra-op width: each batch runs on as many threads as torch
    has at that moment, the width the worker's core ledger granted when workers share the cores
    (an ONNX Runtime pool is fixed at its session's creation). On CUDA the inputs are bound where
    they lie (no host copy)."""

    def __init__(self, name: str, path: Path, device: torch.device) -> None:
        self.name = name
        self.path = path
        self.device = device
        self.spinning = _spinning
        self._sessions: dict[int, Any] = {}
        self._run_options: Any = _shrinking(device) if device.type == "cpu" else None
        self._after_runs = AfterRuns()
        session = self.session
        inputs = [value.name for value in session.get_inputs()]
        outputs = [value.name for value in session.get_outputs()]
        super().__init__(inputs, outputs)

    @property
    def session(self) -> Any:
        """The session for torch's current thread count, opened on first use."""
        threads = self._width()
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

    def share_cores(self, widths: Sequence[int]) -> None:
        if self.device.type == "cpu":
            self.stop_spinning(widths)

    def take_turns(self) -> None:
        """Threads that sleep after a run; on CUDA the arena handed back after each run, so
        the other engine's batches find the memory the plan gave them."""
        if self.device.type == "cpu":
            self.stop_spinning()
        else:
            self._run_options = _shrinking(self.device)

    def memory_probe(self, device_probe: MemoryProbe) -> MemoryProbe:
        """Each measured run on a fresh session: the process's peak on CPU, the device's free
        memory on CUDA."""
        if self.device.type == "cuda":
            return DeviceFreeProbe(self.device, self.fresh_session)
        return ProcessPeakProbe(fresh=self.fresh_session, enough_bytes=ALONE_READING_BYTES)

    @contextlib.contextmanager
    def fresh_session(self) -> Iterator[None]:
        """The current width's session reopened, its arena empty and its threads' scratch gone:
        what the run then allocates is what it needs. On CUDA the arena is kept from shrinking
        at the end of the run while this lasts, so its growth can be read after it."""
        kept = self._run_options
        if self.device.type == "cuda":
            self._run_options = None
        self.release_memory()
        try:
            yield
        finally:
            self._run_options = kept

    def release_memory(self) -> None:
        """The current width's session reopened: its arena and its threads' scratch go back,
        to the system before the new session allocates, so what that one touches is new."""
        self._sessions.pop(self._width(), None)
        release_free_memory()
        _ = self.session

    def _width(self) -> int:
        return torch.get_num_threads() if self.device.type == "cpu" else 0

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        batch = self.plain(batch)
        if self.device.type == "cuda":
            with _out_of_memory_named():
                results = self._run_bound(batch)
        else:
            arrays = self.run_arrays({name: batch[name].numpy() for name in self.inputs})
            results = [arrays[name] for name in self.outputs]
        return {
            name: torch.from_numpy(np.asarray(value))
            for name, value in zip(self.outputs, results, strict=True)
        }

    def run_arrays(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One run on host arrays, by name in and out: what a model with string tensors runs
        on (object arrays of ``str``), as torch holds no strings."""
        started = time.perf_counter()
        with _out_of_memory_named():
            results = self.session.run(list(self.outputs), dict(feeds), self._run_options)
        if self.device.type == "cpu":
            # The arena's growth, handed back when the run ended, stays resident in the C heap,
            # where the next run's regions do not fit again: repeated runs of one batch size
            # held more than one run needs. Back to the system after a long run, and after
            # short ones now and then (what a short run leaves is small).
            self._after_runs.ran(time.perf_counter() - started)
        return {name: np.asarray(value) for name, value in zip(self.outputs, results, strict=True)}

    def _run_bound(self, batch: Mapping[str, torch.Tensor]) -> list[Any]:
        binding = self.session.io_binding()
        index = self.device.index or 0
        for name in self.inputs:
            tensor = batch[name]
            dtype = _numpy_dtype(tensor.dtype)
            binding.bind_input(name, "cuda", index, dtype, list(tensor.shape), tensor.data_ptr())
        for name in self.outputs:
            binding.bind_output(name, "cuda", index)
        # The inputs were written on torch's stream; ONNX Runtime runs on its own.
        torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding, self._run_options)
        return list(binding.copy_outputs_to_cpu())


@contextlib.contextmanager
def _out_of_memory_named() -> Iterator[None]:
    """ONNX Runtime's failed allocations raised as the ``MemoryError`` the batcher recovers
    from (it splits the batch), every other failure as it is."""
    try:
        yield
    except Exception as exc:
        if any(fragment in str(exc) for fragment in _OUT_OF_MEMORY):
            raise MemoryError(f"ONNX Runtime ran out of memory: {exc}") from exc
        raise


def _has_cuda_provider() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _shrinking(device: torch.device) -> Any:
    """Run options that hand the arena's growth back to the system when a run ends."""
    import onnxruntime

    options = onnxruntime.RunOptions()
    arena = "cpu:0" if device.type == "cpu" else f"gpu:{device.index or 0}"
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", arena)
    return options


def _numpy_dtype(dtype: torch.dtype) -> type:
    return type(torch.empty((), dtype=dtype).numpy().dtype.type(0))


def onnx_session(path: Path, device: torch.device, spinning: bool, threads: int) -> Any:
    """An ONNX Runtime session on ``device`` with ``threads`` intra-op threads (0: its default).

    ``spinning`` keeps its threads busy-waiting for a while after each run, as ONNX Runtime does
    by default: faster when it runs every batch, a tax on eager torch when the two take turns
    (docs/engines.md measures both). On CUDA the arena grows by what a run asks, no more, so its
    growth is the run's need.
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
        if not _has_cuda_provider():
            raise ArtifactError(NO_CUDA_PROVIDER)
        cuda = {"device_id": device.index or 0, "arena_extend_strategy": "kSameAsRequested"}
        providers: list[Any] = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = mapped_session(path, device.type, options, providers)
    if session is None:
        session = onnxruntime.InferenceSession(str(path), options, providers=providers)
    _seat_arena(session, device)
    return session


def _seat_arena(session: Any, device: torch.device) -> None:
    """Run the smallest batch the inputs allow first. An arena keeps the first region it
    allocates for good, and a shrink returns only what came after: seated by the smallest
    batch, a session holds next to nothing between runs, so a batch served by another engine
    finds the memory the plan gave it."""
    feeds = {}
    for value in session.get_inputs():
        datatype = ONNX_DATATYPES.get(value.type)
        if datatype is None or datatype == "BYTES":
            return  # strings: a graph reads them as it means to; empty ones may fail it
        shape = [dim if isinstance(dim, int) and dim > 0 else 1 for dim in value.shape]
        feeds[value.name] = np.zeros(shape, dtype=NUMPY_DTYPES[datatype])
    try:
        session.run(None, feeds, _shrinking(device))
    except Exception:
        # A graph that refuses one-element inputs keeps its arena as its first batch sizes it.
        logger.debug("no seating run for %s", session, exc_info=True)


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


def warm_onnx_runtime() -> None:
    """Import ONNX Runtime and run one tiny session, so that what its first session brings in
    (the library, its environment and thread pools) is paid at start-up rather than counted
    as the memory and load time of the first ONNX model loaded later. Nothing without it."""
    try:
        import onnxruntime
        from onnx import TensorProto, helper
    except ImportError:
        return
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "warm",
        [value("X", TensorProto.FLOAT, [1])],
        [value("Y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    session.run(None, {"X": np.zeros(1, dtype=np.float32)})
