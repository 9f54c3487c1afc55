"""Sequence models (Triton's ``sequence_batching``) over HTTP and gRPC with tritonclient: an
accumulator whose sum nograd keeps as Triton's implicit state, fed START and CORRID; sequences
interleaved keep their own sums, different sequences' requests batch together, an unknown
sequence without START and an idle one are refused in Triton's words, an ended id starts again,
and a model without sequence_batching still refuses a sequence id."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import Server, free_port, metric_value, run_server
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  oldest {{ max_candidate_sequences: 16 max_queue_delay_microseconds: {delay_us} }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32
             dims: [ 1 ] }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "CORR" data_type: TYPE_INT64 dims: [ 1 ] }}
]
"""
IDLE_S = 0.3
"""``accumulator_idle``'s idle time: short, so a test waits it out."""
LENGTHS_CONFIG = """
name: "lengths"
backend: "python"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ -1 ] } ]
output [ { name: "SEEN", data_type: TYPE_INT64, dims: [ 1 ] } ]
"""
LENGTHS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            key = request.correlation_id()
            seen = x.size + (0 if start[0, 0] else self.seen[key])
            self.seen[key] = seen
            answer = pb_utils.Tensor("SEEN", np.array([[seen]], np.int64))
            responses.append(pb_utils.InferenceResponse([answer]))
        return responses
"""
"""A Python sequence model of variable length: ``SEEN`` counts the values its sequence sent so
far, so a request that overtook the one before it answers another count (or, overtaking the
START, is refused)."""


def accumulator(path: Path) -> None:
    """``OUTPUT = START ? INPUT : INPUT_STATE + INPUT``, written to ``OUTPUT_STATE`` as well;
    ``CORR`` echoes the CORRID control."""
    import onnx
    from onnx import TensorProto, helper

    def tensor(name: str, kind: int = TensorProto.INT32) -> Any:
        return helper.make_tensor_value_info(name, kind, ["batch", 1])

    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["START"], ["starts"], to=TensorProto.BOOL),
            helper.make_node("Add", ["INPUT_STATE", "INPUT"], ["added"]),
            helper.make_node("Where", ["starts", "INPUT", "added"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["OUTPUT_STATE"]),
            helper.make_node("Cast", ["CORRID"], ["CORR"], to=TensorProto.INT64),
        ],
        "accumulator",
        [
            tensor("INPUT"),
            tensor("START"),
            tensor("CORRID", TensorProto.UINT64),
            tensor("INPUT_STATE"),
        ],
        [tensor("OUTPUT"), tensor("OUTPUT_STATE"), tensor("CORR", TensorProto.INT64)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("sequences")
    repo = root / "repo"
    for name, idle_us, delay_us in (
        ("accumulator", 30_000_000, 50_000),
        ("accumulator_idle", int(IDLE_S * 1e6), 0),
    ):
        accumulator(repo / name / "1" / "model.onnx")
        config = CONFIG.format(name=name, idle_us=idle_us, delay_us=delay_us)
        (repo / name / "config.pbtxt").write_text(config)
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    (repo / "lengths" / "1").mkdir(parents=True)
    (repo / "lengths" / "config.pbtxt").write_text(LENGTHS_CONFIG)
    (repo / "lengths" / "1" / "model.py").write_text(LENGTHS_MODEL)
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_WORKERS": "1",
    }
    with run_server(root, env=env, ready_timeout_s=120) as running:
        yield running


def _client(server: Server, protocol: str) -> Any:
    if protocol == "http":
        return triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    assert server.grpc_address is not None
    return triton_grpc.InferenceServerClient(server.grpc_address)


def _send(client: Any, model: str, value: int, sequence_id: int | str, **flags: bool) -> Any:
    module = triton_http if isinstance(client, triton_http.InferenceServerClient) else triton_grpc
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return client.infer(model, [tensor], sequence_id=sequence_id, **flags)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_interleaved_sequences_keep_their_own_sums(server: Server, protocol: str) -> None:
    client = _client(server, protocol)
    first, second = (101, 102) if protocol == "http" else (201, 202)
    sums: dict[int, list[int]] = {first: [], second: []}
    steps = [(first, 1, True), (second, 100, True), (first, 2, False), (second, -5, False)]
    steps += [(first, 3, False), (second, 7, False)]
    for sequence_id, value, start in steps:
        result = _send(client, "accumulator", value, sequence_id, sequence_start=start)
        sums[sequence_id].append(int(result.as_numpy("OUTPUT")[0, 0]))
        assert int(result.as_numpy("CORR")[0, 0]) == sequence_id  # the CORRID control
        assert result.as_numpy("OUTPUT_STATE") is None  # the state stays in the server
    assert sums == {first: [1, 3, 6], second: [100, 95, 102]}
    # The end releases the id; the next request of it starts again or is refused.
    _send(client, "accumulator", 4, first, sequence_end=True)
    with pytest.raises(InferenceServerException) as refused:
        _send(client, "accumulator", 1, first)
    assert (
        f"inference request for sequence {first} to model 'accumulator' must specify the "
        "START flag on the first request of the sequence" in str(refused.value)
    )
    restarted = _send(client, "accumulator", 9, first, sequence_start=True, sequence_end=True)
    assert int(restarted.as_numpy("OUTPUT")[0, 0]) == 9


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_unknown_sequence_without_start_is_refused_in_triton_s_words(
    server: Server, protocol: str
) -> None:
    client = _client(server, protocol)
    with pytest.raises(InferenceServerException) as refused:
        _send(client, "accumulator", 1, 999_999)
    assert (
        "inference request for sequence 999999 to model 'accumulator' must specify the "
        "START flag on the first request of the sequence" in str(refused.value)
    )
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    with pytest.raises(InferenceServerException) as refused:
        _send(client, "accumulator", 1, 0, sequence_start=True)
    assert (
        "inference request to model 'accumulator' must specify a non-zero or non-empty "
        "correlation ID" in str(refused.value)
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_string_id_over_the_bound_is_refused_and_not_echoed_whole(
    server: Server, protocol: str
) -> None:
    """A 1 MiB string id (NOGRAD_MAX_SEQUENCE_ID_BYTES is 256): 400 naming the bound, with an
    answer that quotes only its start."""
    client = _client(server, protocol)
    with pytest.raises(InferenceServerException) as refused:
        _send(client, "accumulator", 1, "s" * (1 << 20), sequence_start=True)
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    message = str(refused.value)
    assert "longer than the 256 bytes a sequence id may have" in message
    assert "NOGRAD_MAX_SEQUENCE_ID_BYTES" in message and len(message) < 1024


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_idle_sequence_is_released(server: Server, protocol: str) -> None:
    client = _client(server, protocol)
    sequence_id = 301 if protocol == "http" else 302
    _send(client, "accumulator_idle", 5, sequence_id, sequence_start=True)
    time.sleep(IDLE_S * 3)
    with pytest.raises(InferenceServerException) as refused:
        _send(client, "accumulator_idle", 1, sequence_id)
    assert "must specify the START flag on the first request of the sequence" in str(refused.value)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sequence_id_on_a_model_without_sequences_is_refused(
    server: Server, protocol: str
) -> None:
    client = _client(server, protocol)
    module = triton_http if protocol == "http" else triton_grpc
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
        tensors.append(tensor)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("simple", tensors, sequence_id=5, sequence_start=True)
    assert "model 'simple' is not a sequence model" in str(refused.value)
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_requests_of_different_sequences_batch_together(server: Server) -> None:
    """Eight sequences stepping at once: each gets its own running sum, and batches hold rows
    of several sequences (fewer batches than requests)."""
    sequences, steps = 8, 4
    before = {
        part: metric_value(server.url, f"nograd_batch_size_{part}", model="accumulator")
        for part in ("count", "sum")
    }

    def walk(index: int) -> list[int]:
        client = _client(server, "http")
        sequence_id = 1000 + index
        sums = []
        for step in range(steps):
            result = _send(
                client,
                "accumulator",
                index + step,
                sequence_id,
                sequence_start=step == 0,
                sequence_end=step == steps - 1,
            )
            sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
        return sums

    with ThreadPoolExecutor(sequences) as pool:
        walked = list(pool.map(walk, range(sequences)))
    for index, sums in enumerate(walked):
        assert sums == [sum(index + s for s in range(n + 1)) for n in range(steps)]
    batches = metric_value(server.url, "nograd_batch_size_count", model="accumulator")
    rows = metric_value(server.url, "nograd_batch_size_sum", model="accumulator")
    assert rows - before["sum"] == sequences * steps
    assert batches - before["count"] < sequences * steps


def test_a_stream_keeps_a_sequence_s_order_when_its_first_request_is_decoded_in_a_thread(
    server: Server,
) -> None:
    """On one ModelStreamInfer stream, a large START request (its values decoded off the event
    loop) then a small one of the same sequence: the small one waits for its turn rather than
    reaching the sequence first (where it would find no sequence started)."""
    assert server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    answers: Queue[tuple[Any, Any]] = Queue()
    large = np.arange(200_000, dtype=np.int32)[np.newaxis]  # 800 kB: decoded in a thread
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for rounds in range(3):
            sequence_id = 4000 + rounds
            for index, values in enumerate((large, np.ones((1, 1), np.int32), large[:, :2])):
                tensor = triton_grpc.InferInput("INPUT", list(values.shape), "INT32")
                tensor.set_data_from_numpy(values)
                client.async_stream_infer(
                    "lengths",
                    [tensor],
                    request_id=f"{sequence_id}-{index}",
                    sequence_id=sequence_id,
                    sequence_start=index == 0,
                    sequence_end=index == 2,
                )
        got = [answers.get(timeout=60) for _ in range(9)]
    finally:
        client.stop_stream()
        client.close()
    assert [str(error) for _, error in got if error is not None] == []
    seen = {}
    for result, _ in got:
        seen[result.get_response().id] = int(result.as_numpy("SEEN")[0, 0])
    for rounds in range(3):
        first = 4000 + rounds
        assert [seen[f"{first}-{index}"] for index in range(3)] == [200_000, 200_001, 200_003]


def test_a_stream_refuses_an_over_long_id_and_serves_on(server: Server) -> None:
    """On one ModelStreamInfer stream, a request whose string id passes the bound is answered
    with its 400 and takes no place; the stream's next request is served."""
    assert server.grpc_address is not None
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    answers: Queue[tuple[Any, Any]] = Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for index, sequence_id in enumerate(("q" * 4096, 4100)):
            tensor = triton_grpc.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.ones((1, 1), np.int32))
            client.async_stream_infer(
                "lengths",
                [tensor],
                request_id=str(index),
                sequence_id=sequence_id,
                sequence_start=True,
                sequence_end=True,
            )
        got = [answers.get(timeout=60) for _ in range(2)]
    finally:
        client.stop_stream()
        client.close()
    errors = [str(error) for _, error in got if error is not None]
    assert len(errors) == 1 and "NOGRAD_MAX_SEQUENCE_ID_BYTES" in errors[0], errors
    assert len(errors[0]) < 1024
    (served,) = [result for result, error in got if error is None]
    assert int(served.as_numpy("SEEN")[0, 0]) == 1
