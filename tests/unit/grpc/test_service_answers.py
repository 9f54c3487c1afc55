"""The gRPC front of a real serving core, in process, as a client meets it: health calls behind
``NOGRAD_AUTH_HEALTH`` as HTTP's, ``ModelReady`` as Triton answers it, deadlines that are no
deadline refused, unserved RPCs answered UNIMPLEMENTED quietly, and no server path or Python
exception in what a client is told (the log keeps the detail)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import hpack
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nograd.grpc import frames as h2
from nograd.grpc.failures import client_message, status_code
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.server import SERVICE_NAME, GrpcServer
from nograd.grpc.service import OPERATOR_RPCS
from nograd.serving.core import Core
from nograd.serving.errors import (
    HandlerFailed,
    InferenceFailed,
    Kind,
    LoadFailed,
    ModelAnswered,
    ModelNotFound,
    kind_of,
)
from nograd.settings import Settings
from tests.unit.conftest import FIXTURES, count_lookups_and_checks

KEY = "unit-grpc-key-0123456789"
AUTH = (("authorization", f"Bearer {KEY}"),)
INFERENCE_KEY = "unit-grpc-inference-key-0123"


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, **settings: Any) -> AsyncIterator[str]:
    """The gRPC front over a core serving the ``poison`` fixture model, with an API key that is
    an operator key too, and an inference-only key; the address to call."""
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    keys = {"api_keys": f"{KEY},{INFERENCE_KEY}", "operator_api_keys": KEY}
    core = Core(Settings(model_repository=repo, warmup=False, **keys, **settings))
    async with front(core) as address:
        yield address


@contextlib.asynccontextmanager
async def front(core: Core) -> AsyncIterator[str]:
    """The gRPC front over ``core``, opened and loaded here; the address to call."""
    await core.open()
    await asyncio.wait_for(core.load(), 30)
    server = GrpcServer(core)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    await server.start(sock)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await server.stop(0.0)
        await core.close(force=True)


def stub(channel: grpc.aio.Channel, name: str, request: Any, response: Any) -> Any:
    return channel.unary_unary(
        f"/{SERVICE_NAME}/{name}",
        request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )


async def refused(call: Any, request: Any, **kwargs: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(request, timeout=10, **kwargs)
    return raised.value


async def test_health_needs_a_key_exactly_when_http_s_does(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, auth_health=True) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest()
        error = await refused(health.Check, check)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing API key" in (error.details() or "")
        watch = health.Watch(check, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as watched:
            await watch.read()
        assert watched.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = await health.Check(check, metadata=AUTH, timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        live = stub(channel, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse)
        assert (await refused(live, pb.ServerLiveRequest())).code() == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    async with (
        serving(tmp_path / "open") as address,
        grpc.aio.insecure_channel(address) as channel,
    ):  # the default: probes carry no key
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_every_rpc_of_an_operator_group_is_gated() -> None:
    """A new RPC that changes the server names its group, or this fails: none slips through
    with an inference key."""
    definition = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    operator_words = ("Repository", "SharedMemory", "Trace", "Log")
    names = {m.name for m in definition.methods if any(w in m.name for w in operator_words)}
    assert names == set(OPERATOR_RPCS)


async def test_operator_rpcs_are_permission_denied_to_an_inference_key(tmp_path: Path) -> None:
    inference = (("authorization", f"Bearer {INFERENCE_KEY}"),)
    async with serving(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        for name in OPERATOR_RPCS:
            method = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name[name]
            request = getattr(pb, method.input_type.name)
            response = getattr(pb, method.output_type.name)
            call = stub(channel, name, request, response)
            error = await refused(call, request(), metadata=inference)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "This protocol is restricted, expecting an operator key" in (
                error.details() or ""
            )
            assert INFERENCE_KEY not in (error.details() or "")
        # The operator key opens them; the inference key still infers and reads metadata.
        index = stub(
            channel, "RepositoryIndex", pb.RepositoryIndexRequest, pb.RepositoryIndexResponse
        )
        assert (await index(pb.RepositoryIndexRequest(), metadata=AUTH, timeout=10)).models
        ready = stub(channel, "ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse)
        assert (await ready(pb.ServerReadyRequest(), metadata=inference, timeout=10)).ready


async def test_model_ready_answers_as_triton_does_and_needs_a_key(tmp_path: Path) -> None:
    """Triton answers OK with ready false for a model it does not serve (tritonclient's and
    KServe's ``is_model_ready`` return False), INVALID_ARGUMENT in Triton's words for a version
    that is no number or a negative one;
    and the call names models, so it needs the key HTTP's ``/v2/models/{m}/ready`` does."""
    async with serving(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        ready = stub(channel, "ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse)
        asked = pb.ModelReadyRequest(name="poison")
        assert (await ready(asked, metadata=AUTH, timeout=10)).ready
        unknown = pb.ModelReadyRequest(name="nope")
        assert not (await ready(unknown, metadata=AUTH, timeout=10)).ready
        no_version = pb.ModelReadyRequest(name="poison", version="7")
        assert not (await ready(no_version, metadata=AUTH, timeout=10)).ready
        for version, details in (
            (
                "-1",
                "invalid model version specified '-1' , version should be an integral value > 0",
            ),
            *(
                (
                    text,
                    f"failed to get model version from specified version string '{text}' "
                    "(details: stol), version should be an integral value > 0",
                )
                for text in ("abc", "²", "9" * 5000)
            ),
        ):
            bad = pb.ModelReadyRequest(name="poison", version=version)
            error = await refused(ready, bad, metadata=AUTH)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == details
        # As C's stol reads it: leading blanks and zeros, and what follows the digits, left out.
        for version in (" 01", "1abc", str(2**63 - 1)):
            asked = pb.ModelReadyRequest(name="poison", version=version)
            expected = version != str(2**63 - 1)
            assert (await ready(asked, metadata=AUTH, timeout=10)).ready is expected, version
        error = await refused(ready, unknown)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def _headers(path: str, extra: list[tuple[str, str]]) -> bytes:
    return hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "nograd"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
    )


async def _raw_call(
    address: str, path: str, extra: list[tuple[str, str]], body: bytes
) -> dict[str, str]:
    """One call by hand (grpcio never sends a malformed ``grpc-timeout``): its trailers."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0))
        writer.write(h2.frame(h2.HEADERS, h2.END_HEADERS, 1, _headers(path, extra)))
        message = b"\x00" + len(body).to_bytes(4, "big") + body
        writer.write(h2.frame(h2.DATA, h2.END_STREAM, 1, message))
        decoder = hpack.Decoder()
        while True:
            head = await asyncio.wait_for(reader.readexactly(9), 10)
            payload = await asyncio.wait_for(
                reader.readexactly(int.from_bytes(head[:3], "big")), 10
            )
            if head[3] == h2.HEADERS:
                block = dict(decoder.decode(payload, raw=False))
                if head[4] & h2.END_STREAM:
                    return block
            assert head[3] != h2.GOAWAY, payload
    finally:
        writer.close()


async def test_a_grpc_timeout_that_is_no_deadline_is_invalid_argument(tmp_path: Path) -> None:
    """As HTTP answers a negative or malformed ``X-Request-Timeout`` 400, before the body is
    read; ``²S`` used to end the connection with a traceback in the log."""
    request = pb.ModelInferRequest(model_name="poison").SerializeToString()
    async with serving(tmp_path) as address:
        for value in ("-5S", "5", "S", "123456789S", "²S", "1.5S", "+5S"):
            extra = [("grpc-timeout", value), ("authorization", f"Bearer {KEY}")]
            answer = await _raw_call(address, f"/{SERVICE_NAME}/ModelInfer", extra, request)
            assert answer["grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0]), value
            assert "grpc-timeout must be 1 to 8 digits" in answer["grpc-message"]


async def test_a_request_finds_its_model_once_whether_called_or_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelInfer and a stream's request each look their version up once (held until answered)
    and check the inputs they declare once, before decoding."""
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "poison", repo / "poison")
    core = Core(Settings(model_repository=repo, warmup=False))
    lookups, checks = count_lookups_and_checks(monkeypatch, core.plane)
    request = pb.ModelInferRequest(model_name="poison", id="q")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.ones(2, np.float32).tobytes())
    async with front(core) as address, grpc.aio.insecure_channel(address) as channel:
        infer = stub(channel, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        assert (await infer(request, timeout=10)).model_name == "poison"
        assert (lookups, checks) == (["poison"], ["poison"])
        lookups.clear()
        checks.clear()
        stream = channel.stream_stream(
            f"/{SERVICE_NAME}/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        call = stream(timeout=10)
        await call.write(request)
        await call.done_writing()
        answer = await call.read()
        assert answer.infer_response.model_name == "poison", answer.error_message
        assert (lookups, checks) == (["poison"], ["poison"])
        assert core.plane.get("poison").active == 0


async def test_a_timeout_parameter_is_read_as_http_reads_it(tmp_path: Path) -> None:
    """Triton's ``timeout`` parameter goes through the parser HTTP uses: a value that is no
    duration is refused in the same words, not passed over."""
    async with serving(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        infer = stub(channel, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        request = pb.ModelInferRequest(model_name="poison")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
        request.raw_input_contents.append(np.ones(2, np.float32).tobytes())
        request.parameters["timeout"].int64_param = 5_000_000
        answer = await infer(request, timeout=10, metadata=AUTH)
        assert answer.model_name == "poison"
        for value in (-1, "5"):
            if isinstance(value, int):
                request.parameters["timeout"].int64_param = value
            else:
                request.parameters["timeout"].string_param = value
            error = await refused(infer, request, metadata=AUTH)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == (
                f"parameter 'timeout' must be a non-negative integer (µs), got {value!r}"
            )


async def test_a_deadline_already_passed_is_deadline_exceeded(tmp_path: Path) -> None:
    """``0n`` is a valid timeout that has passed: the call is refused, not served without one."""
    async with serving(tmp_path) as address:
        request = pb.ModelInferRequest(model_name="poison")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
        request.raw_input_contents.append(np.ones(2, np.float32).tobytes())
        extra = [("grpc-timeout", "0n"), ("authorization", f"Bearer {KEY}")]
        path = f"/{SERVICE_NAME}/ModelInfer"
        answer = await _raw_call(address, path, extra, request.SerializeToString())
    assert answer["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])


async def test_unserved_rpcs_are_unimplemented_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        stream = channel.stream_stream(
            f"/{SERVICE_NAME}/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        # ModelStreamInfer is served: a request for a model not there is answered in the stream
        # with Triton's error, and the stream ends OK.
        refused = stream(timeout=10)  # no key
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await refused.read()
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = stream(timeout=10, metadata=AUTH)
        await call.write(pb.ModelInferRequest(model_name="nope", id="x"))
        await call.done_writing()
        answer = await call.read()
        assert "Request for unknown model: 'nope' is not found" in answer.error_message
        assert await call.code() == grpc.StatusCode.OK
        # Every RPC of the service is served (LogSettings too): a method of no service is not.
        unary = channel.unary_unary("/no.Such/Method")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await unary(b"", timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


async def test_failures_tell_clients_no_server_path_or_python_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model raising, and a load naming the repository's folder: the client gets what went
    wrong, the log the exception and the path."""
    settings = {"model_control": "explicit", "load_models": "*"}
    async with (
        serving(tmp_path, **settings) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        infer = stub(channel, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        request = pb.ModelInferRequest(model_name="poison")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
        request.raw_input_contents.append(np.full(2, -1.0, np.float32).tobytes())
        failed = await refused(infer, request, metadata=AUTH)
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert "ValueError" not in (failed.details() or "")
        assert "failed on this request" in (failed.details() or "")
        load = stub(
            channel,
            "RepositoryModelLoad",
            pb.RepositoryModelLoadRequest,
            pb.RepositoryModelLoadResponse,
        )
        missing = await refused(
            load, pb.RepositoryModelLoadRequest(model_name="nope"), metadata=AUTH
        )
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope' is not in the repository" in (missing.details() or "")
        assert str(tmp_path) not in (missing.details() or "")
    assert "negative values are out of this model's domain" in caplog.text


def test_client_messages_cut_server_paths_and_hide_internals() -> None:
    cases: list[tuple[BaseException, str]] = [
        (
            ModelNotFound("model 'm' is not in the repository '/srv/nograd/models'"),
            "model 'm' is not in the repository '.../models'",
        ),
        (
            LoadFailed(
                "model 'm' did not load: version 1: load failed: [Errno 2] No such file or "
                "directory: '/home/me/models/m/1/model.safetensors'"
            ),
            "model 'm' did not load: version 1: load failed: [Errno 2] No such file or "
            "directory: '.../model.safetensors'",
        ),
        # Not paths: a client's own method, a URL, a ratio, a single-part name.
        (
            ModelNotFound("see https://example.com/a/b and 1/2 of '/v2'"),
            "see https://example.com/a/b and 1/2 of '/v2'",
        ),
        # A TorchServe handler's failure answer is written for the client: passed on.
        (
            HandlerFailed("the model's handler answered 507: no room in /srv/cache/x"),
            "the model's handler answered 507: no room in .../x",
        ),
        (InferenceFailed("model 'm' failed on this request: KeyError: 'x'"), ""),
        (RuntimeError("<object at 0x7f00> /usr/lib/python3.11/x.py"), ""),
    ]
    for exc, expected in cases:
        told = client_message(exc, kind_of(exc))
        if expected:
            assert told == expected
        else:
            assert kind_of(exc) is Kind.FAILED
            assert "Error" not in told and "/" not in told and "0x" not in told
            assert "server's log" in told


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("UNKNOWN", "UNKNOWN"),
        ("INTERNAL", "INTERNAL"),
        ("NOT_FOUND", "NOT_FOUND"),
        ("INVALID_ARG", "INVALID_ARGUMENT"),
        ("UNAVAILABLE", "UNAVAILABLE"),
        ("UNSUPPORTED", "UNIMPLEMENTED"),
        ("ALREADY_EXISTS", "ALREADY_EXISTS"),
        ("CANCELLED", "CANCELLED"),
    ],
)
def test_a_models_own_error_answer_keeps_its_message_and_tritons_code(
    code: str, expected: str
) -> None:
    """A Triton Python model's ``TritonError`` reaches a gRPC client as Triton's gRPC front
    sends it: the model's message as written, the status code its error code maps to."""
    answered = ModelAnswered("too large for /srv/models/m", 500, code)
    assert client_message(answered, kind_of(answered)) == "too large for /srv/models/m"
    assert status_code(answered, kind_of(answered)).name == expected
