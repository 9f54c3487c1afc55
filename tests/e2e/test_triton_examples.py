"""Triton's own example clients (triton-inference-server/client ``src/python/examples/``, vendored
unchanged in tests/fixtures/triton_client_examples/), run against nograd serving Triton's QA
models, with the flags Triton's QA runs them with (``qa/L0_http``, ``qa/L0_grpc``).

Each example exits 0 when every answer is what it checks for. Those that need what nograd does
not serve yet are expected to fail (strictly: one that starts passing fails this test until its
mark is removed), with the missing piece named; the CUDA shared-memory ones run wherever a GPU
and cuda-python are, and are skipped elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Queue
from typing import Any, NamedTuple

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.cuda import cuda_shared_memory_missing
from tests.e2e.serving import Server, free_port, run_server
from tests.triton_models import FIXTURES
from tests.triton_qa_models import QA_MODELS, qa_repository

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "triton_client_examples"
IMAGE = FIXTURES / "images" / "vulture.jpeg"
RUN_TIMEOUT_S = 60.0


class Example(NamedTuple):
    script: str
    args: tuple[str, ...] = ("-v",)
    grpc: bool = False
    missing: str = ""
    """What nograd lacks for it (expected to fail), or empty."""
    expect: str = ""
    """Text its output must hold besides exiting 0 (Triton's QA greps for it)."""
    cuda: bool = False
    """It keeps tensors in CUDA shared memory: run wherever a GPU and cuda-python are."""
    own_server: bool = False
    """Run against a server of its own: it loads and unloads models, and counts eight of them in
    the repository (Triton's QA runs it against another repository)."""


CUDA_MISSING = cuda_shared_memory_missing()

EXAMPLE_RUNS: dict[str, Example] = {
    "http-health-metadata": Example("simple_http_health_metadata.py"),
    "http-infer": Example("simple_http_infer_client.py"),
    "http-aio-infer": Example("simple_http_aio_infer_client.py"),
    "http-async-infer": Example("simple_http_async_infer_client.py"),
    "http-string-infer": Example("simple_http_string_infer_client.py"),
    "http-reuse-infer-objects": Example("reuse_infer_objects_client.py"),
    "http-model-control": Example("simple_http_model_control.py"),
    "http-image": Example(
        "image_client.py",
        ("-m", "densenet_onnx", "-s", "INCEPTION", "-c", "1", "-b", "1", str(IMAGE)),
        expect="VULTURE",
    ),
    "http-image-async": Example(
        "image_client.py",
        ("-m", "densenet_onnx", "-s", "INCEPTION", "-a", "-c", "1", "-b", "1", str(IMAGE)),
        expect="VULTURE",
    ),
    "http-shm": Example("simple_http_shm_client.py"),
    "http-shm-string": Example("simple_http_shm_string_client.py"),
    "http-sequence-sync": Example("simple_http_sequence_sync_infer_client.py"),
    "http-cudashm": Example("simple_http_cudashm_client.py", cuda=True),
    "grpc-health-metadata": Example("simple_grpc_health_metadata.py", grpc=True),
    "grpc-infer": Example("simple_grpc_infer_client.py", grpc=True),
    "grpc-aio-infer": Example("simple_grpc_aio_infer_client.py", grpc=True),
    "grpc-async-infer": Example("simple_grpc_async_infer_client.py", grpc=True),
    "grpc-string-infer": Example("simple_grpc_string_infer_client.py", grpc=True),
    "grpc-custom-args": Example("simple_grpc_custom_args_client.py", grpc=True),
    "grpc-keepalive": Example("simple_grpc_keepalive_client.py", grpc=True),
    "grpc-model-control": Example(
        "simple_grpc_model_control.py",
        grpc=True,
        own_server=True,
    ),
    # The explicit-content clients exit 0 either way: their last check prints its PASS line.
    "grpc-explicit-int": Example(
        "grpc_explicit_int_content_client.py", grpc=True, expect="PASS: explicit int"
    ),
    "grpc-explicit-int8": Example(
        "grpc_explicit_int8_content_client.py", grpc=True, expect="PASS: explicit int8"
    ),
    "grpc-explicit-byte": Example(
        "grpc_explicit_byte_content_client.py", grpc=True, expect="PASS: explicit string"
    ),
    "grpc-client-stubs": Example("grpc_client.py", grpc=True),
    "grpc-image": Example(
        "grpc_image_client.py",
        ("-m", "densenet_onnx", "-s", "INCEPTION", "-c", "1", "-b", "1", str(IMAGE)),
        grpc=True,
        expect="VULTURE",
    ),
    "grpc-image-via-image-client": Example(
        "image_client.py",
        ("-i", "grpc", "-m", "densenet_onnx", "-s", "INCEPTION", "-c", "1", "-b", "1", str(IMAGE)),
        grpc=True,
        expect="VULTURE",
    ),
    "grpc-image-streaming": Example(
        "image_client.py",
        (
            *("-i", "grpc", "--streaming", "-m", "densenet_onnx", "-s", "INCEPTION"),
            *("-c", "1", "-b", "1", str(IMAGE)),
        ),
        grpc=True,
        expect="VULTURE",
    ),
    "grpc-shm": Example("simple_grpc_shm_client.py", grpc=True),
    "grpc-shm-string": Example("simple_grpc_shm_string_client.py", grpc=True),
    "grpc-sequence-sync": Example("simple_grpc_sequence_sync_infer_client.py", grpc=True),
    "grpc-sequence-stream": Example("simple_grpc_sequence_stream_infer_client.py", grpc=True),
    "grpc-aio-sequence-stream": Example(
        "simple_grpc_aio_sequence_stream_infer_client.py", grpc=True
    ),
    "grpc-custom-repeat": Example(
        "simple_grpc_custom_repeat.py", grpc=True, expect="PASS: Decoupled API"
    ),
    "grpc-cudashm": Example("simple_grpc_cudashm_client.py", grpc=True, cuda=True),
}


@contextmanager
def _qa_server(root: Path, *, with_inception: bool = False) -> Iterator[Server]:
    repo = qa_repository(root, with_inception=with_inception)
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        # The health examples require Triton's name; the model-control ones load and unload
        # ``simple``.
        "NOGRAD_SERVER_NAME": "triton",
        "NOGRAD_MODEL_CONTROL": "explicit",
        "NOGRAD_LOAD_MODELS": ",".join(QA_MODELS),
        # The gRPC model-control example sends a model file whose name is too long, and
        # requires Triton's answer to an upload that cannot be written.
        "NOGRAD_MODEL_UPLOADS": "true",
    }
    with run_server(root, env=env, ready_timeout_s=120) as server:
        yield server


@pytest.fixture(scope="module")
def qa_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with _qa_server(tmp_path_factory.mktemp("triton_qa")) as server:
        yield server


def _marks(example: Example) -> list[pytest.MarkDecorator]:
    if example.cuda:
        return [pytest.mark.skipif(bool(CUDA_MISSING), reason=CUDA_MISSING)]
    if example.missing:
        return [pytest.mark.xfail(reason=f"nograd lacks {example.missing}", strict=True)]
    return []


@pytest.mark.parametrize(
    "example",
    [pytest.param(e, id=name, marks=_marks(e)) for name, e in EXAMPLE_RUNS.items()],
)
def test_triton_example_client(
    qa_server: Server, example: Example, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if example.own_server:
        with _qa_server(tmp_path_factory.mktemp("triton_qa_8"), with_inception=True) as server:
            _run(server, example)
        return
    try:
        _run(qa_server, example)
    finally:
        # The model-control examples end with ``simple`` unloaded; the others need it.
        httpx.post(f"{qa_server.url}/v2/repository/models/simple/load", timeout=60)


def _run(server: Server, example: Example) -> None:
    address = server.grpc_address if example.grpc else server.url.removeprefix("http://")
    assert address is not None
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / example.script), "-u", address, *example.args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=EXAMPLES,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert example.expect in output, output[-3000:]


def _repeat_inputs(module: Any, values: list[int], delay_ms: int) -> list[Any]:
    arrays = (
        ("IN", np.array(values, np.int32), "INT32"),
        ("DELAY", np.full(len(values), delay_ms, np.uint32), "UINT32"),
        ("WAIT", np.array([0], np.uint32), "UINT32"),
    )
    inputs = []
    for name, array, datatype in arrays:
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def test_a_decoupled_model_streams_its_responses_and_refuses_unary_calls(
    qa_server: Server,
) -> None:
    """``repeat_int32`` over the stream: one response per value as the model sends it, then,
    asked for, the empty final response; over HTTP and unary gRPC, Triton's refusal."""
    http = triton_http.InferenceServerClient(qa_server.url.removeprefix("http://"))
    with pytest.raises(InferenceServerException) as refused:
        http.infer("repeat_int32", _repeat_inputs(triton_http, [1, 2], 0))
    assert "HTTP end point doesn't support models with decoupled transaction policy" in str(
        refused.value
    )
    assert qa_server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(qa_server.grpc_address)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("repeat_int32", _repeat_inputs(triton_grpc, [1, 2], 0))
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(
        refused.value
    )
    answers: Queue[tuple[Any, Any]] = Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(
            "repeat_int32",
            _repeat_inputs(triton_grpc, [7, 8, 9], 20),
            enable_empty_final_response=True,
        )
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
        client.close()
    assert [error for _, error in got] == [None] * 4
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert finals == [False, False, False, True]
    assert [int(r.as_numpy("OUT")[0]) for r, _ in got[:3]] == [7, 8, 9]
    assert [int(r.as_numpy("IDX")[0]) for r, _ in got[:3]] == [0, 1, 2]
    assert got[3][0].as_numpy("OUT") is None  # the final flag alone
