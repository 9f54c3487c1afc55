"""CUDA shared-memory regions in the serving core, with the CUDA runtime faked behind
``CudaMemory`` (the real one is exercised by the GPU tests in tests/e2e/test_cuda_shared_memory.py):
the refusal without a GPU, the region table shared with system regions, bounds checked before a
byte moves, handles closed on unregister and at shutdown, and every worker opening a
registration itself."""

from __future__ import annotations

import asyncio
import base64
import re
from pathlib import Path

import numpy as np
import pytest

from nograd.core.errors import DecodeError
from nograd.host.cuda_ipc import IPC_HANDLE_SIZE
from nograd.protocol import shared_memory as shm
from nograd.serving.control.peers import Peers
from nograd.serving.errors import (
    AlreadyExists,
    InvalidInput,
    LimitExceeded,
    LoadFailed,
    RegionNotFound,
)
from nograd.serving.extensions.cuda_shared_memory import decode_handle
from nograd.serving.extensions.shared_memory import SharedMemory, SharedMemoryLimits
from tests.unit.fake_cuda import FakeDevice, no_gpu

HANDLE = b"h" * IPC_HANDLE_SIZE
ROWS = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.fixture
def device() -> FakeDevice:
    return FakeDevice()


async def test_without_a_gpu_register_is_refused_status_and_unregister_answer() -> None:
    regions = SharedMemory(cuda_opener=no_gpu)
    with pytest.raises(InvalidInput) as refused:
        await regions.register_cuda("c", HANDLE, 0, 64)
    assert str(refused.value) == (
        "failed to register CUDA shared memory region: 'c', GPUs not supported"
    )
    assert regions.status(None, "cuda") == []
    with pytest.raises(RegionNotFound, match="Unable to find cuda shared memory region: 'c'"):
        regions.status("c", "cuda")
    await regions.unregister("c", "cuda")
    await regions.unregister(None, "cuda")


async def test_inputs_read_and_outputs_written_through_an_opened_handle(device) -> None:
    memory = device.allocate(HANDLE, 2 * ROWS.nbytes)
    memory[: ROWS.nbytes] = ROWS.tobytes()
    regions = SharedMemory(cuda_opener=lambda: device)
    await regions.register_cuda("c", HANDLE, 0, 2 * ROWS.nbytes)
    assert regions.status(None, "cuda") == [
        {"name": "c", "device_id": 0, "byte_size": 2 * ROWS.nbytes}
    ]
    assert regions.status(None) == []  # not a system region
    place = shm.Placement("c", 0, ROWS.nbytes)
    array = shm.read_input(regions, place, "INPUT0", "INT32", (1, 16))
    np.testing.assert_array_equal(array, ROWS)
    shm.write_output(regions, shm.Placement("c", ROWS.nbytes, ROWS.nbytes), "OUT", ROWS * 2)
    np.testing.assert_array_equal(np.frombuffer(memory[ROWS.nbytes :], np.int32), ROWS[0] * 2)
    await regions.unregister("c", "cuda")
    assert len(device.closed) == 1 and not device.opened
    with pytest.raises(RegionNotFound, match="Unable to find shared memory region: 'c'"):
        regions.read("c", 0, 4)


async def test_bounds_are_checked_before_a_byte_moves(device) -> None:
    device.allocate(HANDLE, 64)
    regions = SharedMemory(cuda_opener=lambda: device)
    await regions.register_cuda("c", HANDLE, 0, 64)
    for offset, size, error in (
        (64, 4, "Invalid offset for shared memory region: 'c'"),
        (60, 8, "Invalid offset + byte size for shared memory region: 'c'"),
    ):
        with pytest.raises(InvalidInput, match=re.escape(error)):
            regions.read("c", offset, size)
        with pytest.raises(InvalidInput, match=re.escape(error)):
            regions.write("c", offset, size, b"x" * size, "OUT")
    with pytest.raises(InvalidInput, match="should be at least 8 bytes"):
        regions.write("c", 0, 4, b"x" * 8, "OUT")
    with pytest.raises(DecodeError, match="Expected 64, got 32"):
        shm.read_input(regions, shm.Placement("c", 0, 32), "INPUT0", "INT32", (1, 16))
    regions.close()  # the server stops: every handle closed
    assert not device.opened


async def test_registrations_refused_with_triton_errors(device) -> None:
    device.allocate(HANDLE, 64)
    regions = SharedMemory(cuda_opener=lambda: device)
    with pytest.raises(InvalidInput, match="must be a valid base64 encoded cudaIpcMemHandle_t"):
        await regions.register_cuda("c", b"short", 0, 64)
    with pytest.raises(InvalidInput) as bad:
        await regions.register_cuda("c", b"?" * IPC_HANDLE_SIZE, 0, 64)
    assert "failed to register shared memory region: invalid args" in str(bad.value)
    assert "cudaIpcOpenMemHandle failed: invalid argument" in str(bad.value)
    with pytest.raises(InvalidInput, match="device_id 1 names no GPU"):
        await regions.register_cuda("c", HANDLE, 1, 64)
    with pytest.raises(InvalidInput, match="'c': invalid args: byte_size 65 is past the end"):
        await regions.register_cuda("c", HANDLE, 0, 65)
    assert not device.opened  # the handle opened to measure it was closed again
    with pytest.raises(InvalidInput, match="device_id must be a non-negative integer"):
        await regions.register_cuda("c", HANDLE, -1, 64)
    assert regions.status(None, "cuda") == []


async def test_one_of_two_registrations_of_a_name_at_once_wins(device) -> None:
    """Handles open off the event loop; the name is taken again once one is open."""
    device.allocate(HANDLE, 64)
    regions = SharedMemory(cuda_opener=lambda: device)
    results = await asyncio.gather(
        regions.register_cuda("c", HANDLE, 0, 64),
        regions.register_cuda("c", HANDLE, 0, 32),
        return_exceptions=True,
    )
    assert sum(isinstance(r, AlreadyExists) for r in results) == 1
    assert len(regions.status(None, "cuda")) == 1 and len(device.opened) == 1
    regions.close()


async def test_names_are_shared_with_system_regions(device, tmp_path: Path) -> None:
    device.allocate(HANDLE, 64)
    regions = SharedMemory(cuda_opener=lambda: device)
    await regions.register_cuda("c", HANDLE, 0, 64)
    with pytest.raises(AlreadyExists, match="shared memory region 'c' already in manager"):
        await regions.register("c", "/nograd_no_such_key", 0, 8)
    with pytest.raises(RegionNotFound) as other:
        regions.status("c")
    assert str(other.value) == (
        "The region named 'c' is registered as CUDA shared memory, not system shared memory"
    )
    await regions.unregister("c")  # the system call leaves a CUDA region alone
    await regions.unregister(None)
    assert [r["name"] for r in regions.status(None, "cuda")] == ["c"]
    await regions.unregister(None, "cuda")
    assert regions.status(None, "cuda") == [] and not device.opened


async def test_every_worker_opens_a_registration_itself(device, tmp_path: Path) -> None:
    """Two workers over the real control channel; a third started later restores the region
    from the shared state. Each opens the handle (the fake counts them)."""
    memory = device.allocate(HANDLE, ROWS.nbytes)
    memory[:] = ROWS.tobytes()

    async def ignore(call: dict[str, object]) -> str | None:
        return None

    workers = [Peers(tmp_path, ignore) for _ in range(2)]
    for number, peers in enumerate(workers):
        peers._path = peers.directory / f"{number}.sock"  # two workers in one test process
        await peers.start()
    try:
        first, second = (SharedMemory(p, cuda_opener=lambda: device) for p in workers)
        await first.register_cuda("c", HANDLE, 0, ROWS.nbytes)
        assert len(device.opened) == 2
        assert second.status(None, "cuda") == first.status(None, "cuda")
        np.testing.assert_array_equal(np.frombuffer(second.read("c", 0, 64), np.int32), ROWS[0])
        later = SharedMemory(Peers(tmp_path, ignore), cuda_opener=lambda: device)
        later.restore()
        assert later.status("c", "cuda")[0]["byte_size"] == ROWS.nbytes
        later.close()
        await second.unregister("c", "cuda")
        assert first.status(None, "cuda") == [] and not device.opened
        # A sibling that cannot open the handle undoes the registration everywhere.
        with_gpu, without = (
            SharedMemory(workers[0], cuda_opener=lambda: device),
            SharedMemory(workers[1], cuda_opener=no_gpu),
        )
        with pytest.raises(LoadFailed, match="GPUs not supported"):
            await with_gpu.register_cuda("d", HANDLE, 0, ROWS.nbytes)
        assert with_gpu.status(None, "cuda") == [] and not device.opened
        assert without.status(None, "cuda") == []
    finally:
        for peers in workers:
            await peers.stop()


async def test_cuda_regions_are_capped_and_their_callers_own(device, tmp_path: Path) -> None:
    """The cap counts both kinds and every caller; a caller sees and unregisters its own, in
    every worker (the caller travels with the registration and the shared state)."""
    device.allocate(HANDLE, 64)

    async def ignore(call: dict[str, object]) -> str | None:
        return None

    workers = [Peers(tmp_path, ignore) for _ in range(2)]
    for number, peers in enumerate(workers):
        peers._path = peers.directory / f"{number}.sock"
        await peers.start()
    limits = SharedMemoryLimits(max_regions=2)
    try:
        first, second = (SharedMemory(p, lambda: device, limits) for p in workers)
        await first.register_cuda("c", HANDLE, 0, 64, caller="alice")
        await first.register_cuda("c", HANDLE, 0, 32, caller="bob")  # a name per caller
        with pytest.raises(LimitExceeded, match="at most 2 shared memory regions"):
            await first.register_cuda("d", HANDLE, 0, 64, caller="carol")
        assert len(device.opened) == 4  # two regions, each opened by both workers
        assert second.status("c", "cuda", "bob")[0]["byte_size"] == 32
        assert second.status(None, "cuda", "carol") == []
        with pytest.raises(RegionNotFound):
            second.read("c", 0, 4, caller="carol")
        later = SharedMemory(Peers(tmp_path, ignore), lambda: device, limits)
        later.restore()
        assert later.status("c", "cuda", "alice")[0]["byte_size"] == 64
        later.close()
        await second.unregister(None, "cuda", caller="bob")
        assert first.status(None, "cuda", "bob") == []
        assert first.status("c", "cuda", "alice")[0]["byte_size"] == 64
        await first.unregister(None, "cuda", caller="alice")
        assert not device.opened
    finally:
        for peers in workers:
            await peers.stop()


def test_the_handle_travels_between_workers_as_base64() -> None:
    assert decode_handle("c", base64.b64encode(HANDLE).decode()) == HANDLE
    with pytest.raises(InvalidInput, match="'raw_handle' of CUDA shared memory region 'c'"):
        decode_handle("c", "not base64!")
