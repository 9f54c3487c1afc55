"""Bodies cost bounded memory and event-loop time: a per-process byte budget for bodies in flight
(503 + Retry-After past it, over HTTP and gRPC alike), and a per-request bound on what decoding
takes, checked before a JSON body is parsed or a binary part read."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.e2e.serving import Server, digits_repository, free_port, metric_value, run_server

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
INFER = "/v2/models/digits/infer"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Watch:
    """Health latency and resident memory of the server, sampled while a test runs."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self.before_mib = rss_mib(server.process.pid)
        self.peak_mib = self.before_mib
        self.slowest_health_s = 0.0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._health), threading.Thread(target=self._rss)]

    def _health(self) -> None:
        with httpx.Client(base_url=self._server.url, timeout=60) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                assert client.get("/v2/health/live").status_code == 200
                self.slowest_health_s = max(self.slowest_health_s, time.perf_counter() - started)
                time.sleep(0.02)

    def _rss(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, rss_mib(self._server.process.pid))
            time.sleep(0.01)

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)
        self._stop.set()
        for thread in self._threads:
            thread.join()


def post_watched(
    server: Server, body: bytes, headers: dict[str, str]
) -> tuple[httpx.Response, float, Watch]:
    """The answer to ``body``, its seconds, and the server's health and memory meanwhile."""
    with Watch(server) as watch, httpx.Client(base_url=server.url, timeout=60) as client:
        started = time.perf_counter()
        response = client.post(INFER, content=body, headers=headers)
        took = time.perf_counter() - started
    return response, took, watch


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("budget")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(digits_repository(tmp)),
        "NOGRAD_ENGINE": "eager",
        "NOGRAD_GRPC_PORT": str(free_port()),
    }
    with run_server(tmp, env=env) as running:
        yield running


def test_a_json_body_that_would_decode_past_the_bound_is_refused_unparsed(server: Server) -> None:
    """30 MiB of JSON zeros took seconds of the event loop and hundreds of MiB to decode."""
    count = 15 * MIB
    body = (
        b'{"inputs":[{"name":"image","shape":[%d],"datatype":"FP32","data":[' % count
        + b"0," * (count - 1)
        + b"0]}]}"
    )
    response, took, watch = post_watched(server, body, {"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "NOGRAD_MAX_DECODED_BYTES" in response.json()["error"]
    assert took < 10
    assert watch.slowest_health_s < 1.0
    assert watch.peak_mib - watch.before_mib < 200
    assert metric_value(server.url, "nograd_rejected_total", reason="too_large") >= 1


def gzip_bomb(inflated_mib: int) -> bytes:
    """A valid gzip body of ``inflated_mib`` MiB of zeros, about a thousand times smaller: one
    compressed MiB of zeros (a full flush makes each such block independent) repeated."""
    zeros = bytes(MIB)
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = deflater.compress(zeros) + deflater.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated_mib):
        crc = zlib.crc32(zeros, crc)
    trailer = struct.pack("<II", crc, (inflated_mib * MIB) & 0xFFFFFFFF)
    return (
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
        + block * inflated_mib
        + deflater.flush()
        + trailer
    )


def test_a_gzip_bomb_is_refused_after_the_request_limit_in_bounded_memory(server: Server) -> None:
    """A GiB of zeros in a MiB of gzip is inflated only up to NOGRAD_MAX_REQUEST_BYTES (64 MiB),
    a piece at a time off the event loop, then refused with 413."""
    bomb = gzip_bomb(1024)
    assert len(bomb) < 2 * MIB
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    response, took, watch = post_watched(server, bomb, headers)
    assert response.status_code == 413, response.text
    assert "once decompressed (NOGRAD_MAX_REQUEST_BYTES)" in response.json()["error"]
    assert took < 10
    assert watch.slowest_health_s < 1.0
    assert watch.peak_mib - watch.before_mib < 200


def test_a_binary_body_is_checked_against_the_model_before_its_binary_part_is_read(
    server: Server,
) -> None:
    """15.7M BYTES elements for a model taking FP32: seconds of parsing before, none now."""
    rows, columns = 4096, 3840
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [rows, columns],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 * rows * columns},
                }
            ]
        }
    ).encode()
    body = header + bytes(4 * rows * columns)
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    response, took, watch = post_watched(server, body, headers)
    assert response.status_code == 400, response.text
    assert "but model 'digits' expects 'FP32'" in response.json()["error"]
    # Parsed first, the elements took over 200 MiB and seconds of the event loop.
    assert watch.peak_mib - watch.before_mib < 200
    assert watch.slowest_health_s < 1.0
    assert took < 5


def _hold_body(url: str, size: int) -> socket.socket:
    """A connection whose request declares ``size`` bytes of body and sends only a few."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST {INFER} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {size}\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"inputs":')
    return sock


def answered(client: httpx.Client, document: object, status: int) -> httpx.Response:
    """The answer to ``document`` once it has ``status`` (tried for up to 30 s), or the last."""
    deadline = time.monotonic() + 30
    while True:
        response = client.post(INFER, json=document)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


@pytest.fixture
def small_budget(tmp_path: Path) -> Iterator[Server]:
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(digits_repository(tmp_path)),
        "NOGRAD_ENGINE": "eager",
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_MAX_REQUEST_BYTES": str(MIB),
        "NOGRAD_MAX_DECODED_BYTES": str(MIB),
        "NOGRAD_MAX_BODY_BYTES_IN_FLIGHT": str(3 * MIB),
    }
    with run_server(tmp_path, env=env) as running:
        yield running


def test_bodies_past_the_byte_budget_get_503_over_http_and_grpc(small_budget: Server) -> None:
    """Three bodies of 1 MiB in flight fill a 3 MiB budget: one more body, sized or chunked,
    HTTP or gRPC, is refused at once; once they go, requests pass again."""
    url = small_budget.url
    image = {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}
    held = [_hold_body(url, MIB) for _ in range(3)]
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            # The server has read the three heads once a request is refused.
            response = answered(client, {"inputs": [image]}, 503)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert "NOGRAD_MAX_BODY_BYTES_IN_FLIGHT" in response.json()["error"]

            def chunks() -> Iterator[bytes]:
                yield json.dumps({"inputs": [image]}).encode()

            chunked = client.post(INFER, content=chunks())
            assert chunked.status_code == 503, chunked.text
            # Health is never refused for the bodies inference holds.
            assert client.get("/v2/health/ready").status_code == 200

        assert small_budget.grpc_address is not None
        request = service_pb2.ModelInferRequest(model_name="digits")
        request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
        request.raw_input_contents.append(np.zeros(64, np.float32).tobytes())
        with grpc.insecure_channel(small_budget.grpc_address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "NOGRAD_MAX_BODY_BYTES_IN_FLIGHT" in (refused.value.details() or "")
            trailing = dict(refused.value.trailing_metadata() or ())
            assert trailing.get("retry-after") == "1"
    finally:
        for sock in held:
            sock.close()
    rejected = metric_value(url, "nograd_rejected_total", reason="bytes_in_flight")
    assert rejected >= 3
    with httpx.Client(base_url=url, timeout=30) as client:
        # The closed connections give their bytes back once the server sees them close.
        response = answered(client, {"inputs": [image]}, 200)
    assert response.status_code == 200, response.text
