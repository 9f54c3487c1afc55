"""Live tensor tracking: the CPU probe's measure of a forward's peak extra bytes."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


# torch leaves TorchDispatchMode untyped, hence the no-untyped-call ignores below.
class LiveTensorTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts bytes of tensor storages created while active, with their live peak.

    Process RSS is useless for sizing CPU batches: the allocator keeps freed pages, other
    threads allocate concurrently and the number is noisy at the scale of one activation.
    Intercepting every ATen op instead gives an exact, deterministic account of the tensor
    storages a forward creates and how long each one lives.

    Only storages *created* by ops while the mode is active are counted: an output whose
    storage is also one of the op's inputs (views of weights, in-place ops, ``out=``) belongs
    to someone else.  Views share their base's storage, so counting per storage counts every
    buffer once.  Storages are released through ``weakref.finalize`` so ``current_bytes``
    falls as soon as Python drops the last tensor referencing a buffer, even after the mode
    has exited.

    Limitations worth knowing when reading the numbers: scratch buffers a kernel allocates
    and frees internally (oneDNN/BLAS workspaces) are invisible, as are ops run on other
    threads, since dispatch modes are thread-local.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Once dynamo is loaded (something may compile), the variant whose dispatch dynamo never
        # traces, as torch makes every dispatch mode by default.
        chosen: type[LiveTensorTracker] = cls
        if cls is LiveTensorTracker and "torch._dynamo" in sys.modules:
            chosen = _OutsideDynamoTracker
        return cast(Self, super().__new__(chosen))

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Not here: torch would wrap ``__torch_dispatch__`` in ``torch._disable_dynamo``, whose
        first call loads torch's compiler stack (seconds at every server start) in a process
        that may never compile; ``_OutsideDynamoTracker`` keeps that wrapping."""
        return False

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.current_bytes = 0
        self.peak_bytes = 0
        # Finalizers can run on any thread and, via GC, re-enter while we hold the lock.
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}

    def __enter__(self) -> Self:
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]

    @property
    def live_storages(self) -> int:
        """Number of tracked storages still alive; lets tests prove nothing leaked."""
        with self._lock:
            return len(self._live)

    def reset_peak(self) -> None:
        """Starts a new peak window without forgetting what is still alive."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        input_storages: set[int] | None = None
        for leaf in tree_leaves(out):
            storage = self._storage_of(leaf)
            if storage is None:
                continue
            key = id(storage)
            with self._lock:
                if key in self._live:
                    # Seen before: only its size can have changed (resize_, out= growth).
                    self._set_size(key, storage.nbytes())
                    continue
            if input_storages is None:
                inputs = map(self._storage_of, tree_leaves((args, kwargs)))
                input_storages = {id(s) for s in inputs if s is not None}
            if key not in input_storages:
                self._track(storage)
        return out

    def _storage_of(self, leaf: object) -> torch.UntypedStorage | None:
        if not (
            isinstance(leaf, torch.Tensor)
            and leaf.device.type == self.device_type
            and leaf.layout == torch.strided
        ):
            return None
        try:
            return leaf.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Storage-less tensor subclasses: nothing we could attribute bytes to.
            return None

    def _track(self, storage: torch.UntypedStorage) -> None:
        # id() is a stable key: torch preserves one Python object per live storage, and the
        # finalizer removes the key before the id can be reused.
        key = id(storage)
        with self._lock:
            self._live[key] = 0
            self._set_size(key, storage.nbytes())
        finalizer = weakref.finalize(storage, self._release, key)
        finalizer.atexit = False

    def _set_size(self, key: int, nbytes: int) -> None:
        self.current_bytes += nbytes - self._live[key]
        self._live[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(key, 0)


class _OutsideDynamoTracker(LiveTensorTracker):  # type: ignore[no-untyped-call]
    """The tracker once dynamo is loaded: torch wraps this class's ``__torch_dispatch__`` so that
    dynamo never traces it (``TorchDispatchMode.__init_subclass__``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    def __torch_dispatch__(self, *call: Any, **named: Any) -> object:
        return super().__torch_dispatch__(*call, **named)
