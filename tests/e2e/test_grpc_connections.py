"""The gRPC port holds the same connection limits as HTTP's: at most ``NOGRAD_MAX_CONNECTIONS``
per process (one more is turned away at once, UNAVAILABLE to its client, and served again once
others close), and a connection that never sends HTTP/2's preface is closed after
``NOGRAD_HEADER_TIMEOUT_S``: idle sockets cannot take the process's file descriptors."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.e2e.serving import digits_repository, free_port, metric_value, run_server

pytestmark = pytest.mark.e2e
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
GOAWAY = 0x7
ENHANCE_YOUR_CALM = 0xB
MAX_CONNECTIONS = 4


def infer(address: str) -> str:
    """One ModelInfer on a channel of its own: its status code's name."""
    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
    request.raw_input_contents.append(np.zeros(64, np.float32).tobytes())
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(request, timeout=10)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return "OK"


def frames_until_closed(conn: socket.socket, timeout_s: float) -> list[tuple[int, bytes]]:
    """Every frame (type, payload) the server sends until it closes the connection."""
    conn.settimeout(timeout_s)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    frames = []
    while len(data) >= 9:
        high, low, kind = struct.unpack_from(">HBB", data)
        length = (high << 8) | low
        frames.append((kind, data[9 : 9 + length]))
        data = data[9 + length :]
    return frames


def test_grpc_connections_are_capped_and_silent_ones_closed(tmp_path: Path) -> None:
    grpc_port = free_port()
    address = f"127.0.0.1:{grpc_port}"
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(digits_repository(tmp_path)),
        "NOGRAD_GRPC_PORT": str(grpc_port),
        "NOGRAD_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "NOGRAD_HEADER_TIMEOUT_S": "2",
    }
    with run_server(tmp_path, env) as server:
        assert infer(address) == "OK"
        time.sleep(1.0)  # that channel's connection closed on the server's side too
        # Connections that spoke HTTP/2 and then hold still: within the cap, kept open.
        held = [socket.create_connection(("127.0.0.1", grpc_port)) for _ in range(MAX_CONNECTIONS)]
        for conn in held:
            conn.sendall(PREFACE + EMPTY_SETTINGS)
        time.sleep(0.5)
        for conn in held:
            conn.settimeout(0.5)
            assert struct.unpack_from(">B", conn.recv(65536), 3)[0] != GOAWAY
        # One more: answered at once with GOAWAY (ENHANCE_YOUR_CALM) and closed.
        extra = socket.create_connection(("127.0.0.1", grpc_port))
        started = time.monotonic()
        frames = frames_until_closed(extra, 5)
        assert time.monotonic() - started < 1.5
        goaways = [payload for kind, payload in frames if kind == GOAWAY]
        assert len(goaways) == 1
        assert struct.unpack_from(">L", goaways[0], 4)[0] == ENHANCE_YOUR_CALM
        assert b"NOGRAD_MAX_CONNECTIONS=4" in goaways[0]
        extra.close()
        started = time.monotonic()
        assert infer(address) == "UNAVAILABLE"
        assert time.monotonic() - started < 3  # refused, not retried until its deadline
        assert metric_value(server.url, "nograd_rejected_total", reason="too_many_connections") >= 2
        for conn in held:
            conn.close()
        time.sleep(0.5)
        assert infer(address) == "OK"
        # A connection that never sends the preface is closed after the header timeout.
        silent = socket.create_connection(("127.0.0.1", grpc_port))
        started = time.monotonic()
        frames = frames_until_closed(silent, 10)
        waited = time.monotonic() - started
        silent.close()
        assert 1.5 < waited < 6, waited
        assert GOAWAY in [kind for kind, _ in frames]
        assert infer(address) == "OK"
