"""What a ``ModelStreamInfer`` client that takes no answers can make the server hold, attacked
with a raw HTTP/2 client that grants no window (it reads its socket, so only HTTP/2 flow control
holds the answers): a decoupled model that would send 50,000 responses sends a few hundred
while nobody takes them, and the rest are dropped once the stream is reset; 1,000 requests
for 256 KiB answers, sent as fast as they are served, keep the worker's memory flat; another
client is served meanwhile."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import hpack
import numpy as np
import pytest
import tritonclient.grpc as triton

from nograd.grpc import frames as h2
from nograd.grpc.generated import grpc_service_pb2 as pb
from tests.e2e.serving import Server, free_port, run_server
from tests.e2e.test_memory_return import rss_mib

pytestmark = pytest.mark.e2e

FLOOD_RESPONSES = 50_000
UNSENT_TIMEOUT_S = 3
PATH = "/inference.GRPCInferenceService/ModelStreamInfer"

FLOOD_CONFIG = """
name: "flood"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
FLOOD_MODEL = """
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.progress = Path(args["model_repository"]) / "sent"

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            threading.Thread(target=self.flood, args=(sender, count)).start()
        return None

    def flood(self, sender, count):
        for index in range(count):
            out = pb_utils.Tensor("OUT", np.array([index], np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
            if index % 50 == 0:
                self.progress.write_text(str(index + 1))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.progress.write_text(f"{count} done")
"""
"""A decoupled model sending ``COUNT`` responses from a thread of its own, writing how many it
has sent so far next to its config."""

BIG_CONFIG = """
name: "big"
backend: "python"
max_batch_size: 0
input [ { name: "SEED", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 65536 ] } ]
"""
BIG_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            seed = pb_utils.get_input_tensor_by_name(request, "SEED").as_numpy()[0]
            out = pb_utils.Tensor("OUT", np.full(65536, seed, np.float32))
            answers.append(pb_utils.InferenceResponse([out]))
        return answers
"""
"""256 KiB of output per request."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("unsent")
    repo = root / "repo"
    for name, config, model in (
        ("flood", FLOOD_CONFIG, FLOOD_MODEL),
        ("big", BIG_CONFIG, BIG_MODEL),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(model)
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(repo),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_GRPC_MAX_UNSENT_STREAM_BYTES": str(16 * 1024),
        "NOGRAD_GRPC_MAX_UNSENT_CONNECTION_BYTES": str(1024 * 1024),
        "NOGRAD_GRPC_UNSENT_TIMEOUT_S": str(UNSENT_TIMEOUT_S),
        "NOGRAD_MAX_QUEUED_RESPONSES": "8",
    }
    with run_server(root, env=env, ready_timeout_s=120) as started:
        yield started


class WindowlessClient:
    """A raw HTTP/2 client whose streams grant the server no window: it reads every frame the
    server sends (recording resets) and never sends WINDOW_UPDATE."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=10)
        self._encoder = hpack.Encoder()
        self.resets: dict[int, int] = {}
        """Stream -> error code of each RST_STREAM received."""
        settings = struct.pack(">HL", h2.SETTINGS_INITIAL_WINDOW_SIZE, 0)
        self._sock.sendall(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, settings))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        try:
            while chunk := self._sock.recv(65536):
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, stream = buffer[3], int.from_bytes(buffer[5:9], "big")
                    if kind == h2.RST_STREAM:
                        self.resets[stream] = struct.unpack(">L", buffer[9:13])[0]
                    buffer = buffer[9 + length :]
        except OSError:
            return

    def open(self, stream: int) -> None:
        headers = self._encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", PATH),
                (":authority", "nograd"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )
        self._sock.sendall(h2.frame(h2.HEADERS, h2.END_HEADERS, stream, headers))

    def send(self, stream: int, requests: list[pb.ModelInferRequest]) -> None:
        body = b""
        for request in requests:
            payload = request.SerializeToString()
            body += b"\x00" + len(payload).to_bytes(4, "big") + payload
        out = b""
        for offset in range(0, len(body), 16384):
            out += h2.frame(h2.DATA, 0, stream, body[offset : offset + 16384])
        self._sock.sendall(out)

    def reset_within(self, stream: int, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while stream not in self.resets and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.resets.get(stream)

    def close(self) -> None:
        self._sock.close()
        self._reader.join(5)


def request(model: str, name: str, value: int) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name=name, datatype="INT32", shape=[1])
    message.raw_input_contents.append(np.array([value], np.int32).tobytes())
    return message


def sent(progress: Path) -> str:
    """What the model wrote last (read again while it is being rewritten)."""
    for _ in range(100):
        try:
            if text := progress.read_text():
                return text
        except FileNotFoundError:
            return "0"
        time.sleep(0.01)
    raise AssertionError("the model's progress file stays empty")


def served_meanwhile(server: Server) -> None:
    assert server.grpc_address is not None
    with triton.InferenceServerClient(server.grpc_address) as other:
        seed = triton.InferInput("SEED", [1], "INT32")
        seed.set_data_from_numpy(np.array([7], np.int32))
        started = time.monotonic()
        answer = other.infer("big", [seed], client_timeout=10)
        assert float(answer.as_numpy("OUT")[0]) == 7.0
        assert time.monotonic() - started < 10


def test_a_decoupled_model_sends_only_what_the_queues_hold_for_a_windowless_client(
    server: Server,
) -> None:
    progress = Path(server.log_path).parent / "repo" / "flood" / "sent"
    assert server.grpc_address is not None
    client = WindowlessClient(server.grpc_address)
    try:
        client.open(1)
        client.send(1, [request("flood", "COUNT", FLOOD_RESPONSES)])
        time.sleep(2)
        held = int(sent(progress).split()[0])
        time.sleep(0.5)
        # Before, the model sent all 50,000 at once and the server held every one.
        assert 0 < held < 1000 and int(sent(progress).split()[0]) < 1000
        served_meanwhile(server)
        assert client.reset_within(1, UNSENT_TIMEOUT_S + 10) == h2.ENHANCE_YOUR_CALM
        deadline = time.monotonic() + 60
        while not sent(progress).endswith("done") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sent(progress) == f"{FLOOD_RESPONSES} done"  # its sends dropped, not held
    finally:
        client.close()


def test_a_thousand_answers_not_taken_keep_memory_flat(server: Server) -> None:
    assert server.grpc_address is not None
    served_meanwhile(server)  # the model's first call made, its memory counted
    before = rss_mib(server.process.pid)
    client = WindowlessClient(server.grpc_address)
    try:
        client.open(1)
        peak = before
        for start in range(0, 1000, 25):  # paced, so that each is served, not shed
            client.send(1, [request("big", "SEED", index) for index in range(start, start + 25)])
            for _ in range(5):
                peak = max(peak, rss_mib(server.process.pid))
                time.sleep(0.05)
        # Before, every 256 KiB answer stayed in the stream: 250 MiB.
        assert peak - before < 80, (before, peak)
        served_meanwhile(server)
        assert client.reset_within(1, UNSENT_TIMEOUT_S + 10) is not None
    finally:
        client.close()
