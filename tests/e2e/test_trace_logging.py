"""Triton's trace and logging extensions with tritonclient's own calls over HTTP and gRPC: each
setting read and changed, a model's setting falling back to the global one when cleared, bad
settings refused naming them, sampled requests written to Triton's trace file with the rate and
count honoured, log switches changing what the server logs, and traces sent as OTLP spans to a
collector with the caller's ``traceparent`` as their parent."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tritonclient.utils import InferenceServerException

from tests.e2e.serving import Server, free_port, run_server
from tests.triton_models import FIXTURES

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
CHAIN_TRACE_ID = "2" * 32
OFF = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0"}


CHAIN = """
name: "simple_chain"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
  { name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ] }
]
output [
  { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
  { name: "OUTPUT1", data_type: TYPE_INT32, dims: [ 16 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "simple"
      model_version: -1
      input_map { key: "INPUT0" value: "INPUT0" }
      input_map { key: "INPUT1" value: "INPUT1" }
      output_map { key: "OUTPUT0" value: "sum" }
      output_map { key: "OUTPUT1" value: "difference" }
    },
    {
      model_name: "simple"
      model_version: -1
      input_map { key: "INPUT0" value: "sum" }
      input_map { key: "INPUT1" value: "difference" }
      output_map { key: "OUTPUT0" value: "OUTPUT0" }
      output_map { key: "OUTPUT1" value: "OUTPUT1" }
    }
  ]
}
"""
"""Triton's ``simple`` twice in a row: (a + b) + (a - b) and (a + b) - (a - b)."""


def _repository(root: Path) -> Path:
    repo = root / "repo"
    shutil.copytree(FIXTURES / "simple", repo / "simple")
    (repo / "simple_chain" / "1").mkdir(parents=True)
    (repo / "simple_chain" / "config.pbtxt").write_text(CHAIN)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("trace")
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(_repository(root)),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_TRACE_FILE": str(root / "trace.json"),
    }
    with run_server(root, env=env, ready_timeout_s=120) as running:
        yield running


def _http(server: Server) -> triton_http.InferenceServerClient:
    return triton_http.InferenceServerClient(server.url.removeprefix("http://"))


def _grpc(server: Server) -> triton_grpc.InferenceServerClient:
    assert server.grpc_address is not None
    return triton_grpc.InferenceServerClient(server.grpc_address)


def _http_infer(
    client: triton_http.InferenceServerClient,
    headers: dict[str, str] | None = None,
    model: str = "simple",
    request_id: str = "",
):
    inputs = [triton_http.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for each in inputs:
        each.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    return client.infer(model, inputs, headers=headers, request_id=request_id)


def _grpc_infer(client: triton_grpc.InferenceServerClient, headers: dict[str, str] | None = None):
    inputs = [triton_grpc.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for each in inputs:
        each.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    return client.infer("simple", inputs, headers=headers)


def test_trace_settings_over_http_with_a_model_falling_back(server: Server) -> None:
    client = _http(server)
    try:
        assert client.get_trace_settings() == {
            **OFF,
            "trace_file": str(Path(server.log_path).parent / "trace.json"),
            "trace_mode": "triton",
        }
        changed = client.update_trace_settings(settings={"trace_rate": "7", "log_frequency": "5"})
        assert changed["trace_rate"] == "7" and changed["log_frequency"] == "5"
        model = client.update_trace_settings("simple", {"trace_count": "4"})
        assert model["trace_count"] == "4" and model["trace_rate"] == "7"  # the rest: global's
        client.update_trace_settings(settings={"trace_rate": "9"})
        assert client.get_trace_settings("simple")["trace_rate"] == "9"  # follows the global
        cleared = client.update_trace_settings("simple", {"trace_count": None})
        assert cleared["trace_count"] == "-1"
    finally:
        client.update_trace_settings(settings={name: None for name in OFF})
    assert {k: v for k, v in client.get_trace_settings().items() if k in OFF} == OFF


def test_trace_settings_over_grpc(server: Server) -> None:
    client = _grpc(server)
    try:
        answer = client.update_trace_settings(
            "simple", {"trace_level": ["TIMESTAMPS"], "trace_rate": "2"}, as_json=True
        )
        assert answer["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
        assert answer["settings"]["trace_rate"]["value"] == ["2"]
        assert client.get_trace_settings(as_json=True)["settings"]["trace_level"]["value"] == [
            "OFF"
        ]
        cleared = client.update_trace_settings("simple", {"trace_level": None}, as_json=True)
        assert cleared["settings"]["trace_level"]["value"] == ["OFF"]
    finally:
        client.update_trace_settings("simple", {"trace_rate": None, "trace_level": None})


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"trace_colour": "red"}, "unknown trace setting 'trace_colour'"),
        ({"trace_level": ["LOUD"]}, "Unable to parse 'trace_level', got: LOUD"),
        ({"trace_level": ["TENSORS"]}, "'TENSORS' is not supported"),
        (
            {"trace_rate": "-1"},
            "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], got: -1",
        ),
        ({"trace_count": "x"}, "Unable to parse 'trace_count', got: x"),
        ({"trace_file": "/tmp/x"}, "trace file location can not be updated through network"),
    ],
)
def test_a_bad_trace_setting_is_refused_naming_it(server: Server, settings, words) -> None:
    # Triton answers a file's location 501 / UNIMPLEMENTED, the rest 400 / INVALID_ARGUMENT.
    fixed = "trace_file" in settings
    answer = httpx.post(f"{server.url}/v2/trace/setting", json=settings, timeout=10)
    assert answer.status_code == (501 if fixed else 400)
    assert words in answer.json()["error"]
    with pytest.raises(InferenceServerException) as refused:
        _grpc(server).update_trace_settings(settings=settings)
    code = "UNIMPLEMENTED" if fixed else "INVALID_ARGUMENT"
    assert refused.value.status() == f"StatusCode.{code}"
    assert _http(server).get_trace_settings()["trace_level"] == ["OFF"]  # nothing changed


def test_an_unknown_model_s_trace_setting_is_refused(server: Server) -> None:
    answer = httpx.get(f"{server.url}/v2/models/nope/trace/setting", timeout=10)
    assert answer.status_code == 400
    assert answer.json()["error"] == "Request for unknown model : nope"


def test_sampled_requests_go_to_triton_s_trace_file(server: Server) -> None:
    http, grpc = _http(server), _grpc(server)
    trace_file = Path(server.log_path).parent / "trace.json"
    http.update_trace_settings(
        settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "3", "trace_count": "2"}
    )
    try:
        for index in range(9):
            _http_infer(http) if index % 2 else _grpc_infer(grpc)
        assert http.get_trace_settings()["trace_count"] == "0"
        written = trace_file.with_name("trace.json.0")
        deadline = time.monotonic() + 10
        while not written.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = json.loads(written.read_text())
    finally:
        http.update_trace_settings(settings={name: None for name in OFF})
    heads = [e for e in entries if "model_name" in e]
    assert len(heads) == 2  # requests 3 and 6 of 9; the count ran out before 9
    assert all(h["model_name"] == "simple" and h["model_version"] == 1 for h in heads)
    for head in heads:
        stamps = [
            e["timestamps"][0] for e in entries if e["id"] == head["id"] and "timestamps" in e
        ]
        names = [s["name"] for s in stamps]
        assert names == [
            "REQUEST_START",
            "QUEUE_START",
            "COMPUTE_START",
            "COMPUTE_END",
            "REQUEST_END",
        ]
        assert [s["ns"] for s in stamps] == sorted(s["ns"] for s in stamps)


def _stamps(entries: list[dict], trace_id: int) -> dict[str, int]:
    return {
        e["timestamps"][0]["name"]: e["timestamps"][0]["ns"]
        for e in entries
        if e["id"] == trace_id and "timestamps" in e
    }


def test_an_ensemble_traces_each_step_as_a_child_trace(server: Server) -> None:
    http = _http(server)
    folder = Path(server.log_path).parent
    before = set(folder.glob("trace.json.*"))
    http.update_trace_settings(
        "simple_chain", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1"}
    )
    try:
        answer = _http_infer(http, model="simple_chain", request_id="chained")
        assert (answer.as_numpy("OUTPUT0") == 2).all() and (answer.as_numpy("OUTPUT1") == 2).all()
        deadline = time.monotonic() + 10
        while not (set(folder.glob("trace.json.*")) - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        (written,) = set(folder.glob("trace.json.*")) - before
        entries = json.loads(written.read_text())
    finally:
        http.update_trace_settings("simple_chain", {name: None for name in OFF})
    heads = [e for e in entries if "model_name" in e]
    ensemble, *steps = heads
    # Triton's: the ensemble's own trace, then one per step naming it as parent_id.
    assert ensemble == {
        "id": ensemble["id"],
        "model_name": "simple_chain",
        "model_version": 1,
        "request_id": "chained",
    }
    assert [s["model_name"] for s in steps] == ["simple", "simple"]
    assert all(s["parent_id"] == ensemble["id"] and s["request_id"] == "chained" for s in steps)
    assert len({ensemble["id"], *(s["id"] for s in steps)}) == 3
    outer = _stamps(entries, ensemble["id"])
    assert list(outer) == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]  # no compute of its own
    first, second = (_stamps(entries, s["id"]) for s in steps)
    for inner in (first, second):
        assert list(inner) == [
            "REQUEST_START",
            "QUEUE_START",
            "COMPUTE_START",
            "COMPUTE_END",
            "REQUEST_END",
        ]
        assert outer["QUEUE_START"] <= inner["REQUEST_START"]
        assert inner["REQUEST_END"] <= outer["REQUEST_END"]
    assert first["COMPUTE_END"] <= second["COMPUTE_START"]  # the second step takes the first's


def test_log_settings_change_what_the_server_logs(server: Server) -> None:
    http, grpc = _http(server), _grpc(server)
    assert http.get_log_settings() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "json",
    }
    try:
        answer = grpc.update_log_settings({"log_verbose_level": 1}, as_json=True)
        assert answer["settings"]["log_verbose_level"] == {"uint32_param": 1}
        _http_infer(http, headers={"X-Request-Id": "verbose-on"})
        time.sleep(0.2)
        assert '"request_id":"verbose-on"' in server.log()  # the per-request debug line
        http.update_log_settings({"log_verbose_level": 0, "log_info": False})
        _http_infer(http, headers={"X-Request-Id": "verbose-off"})
        time.sleep(0.2)
        assert '"request_id":"verbose-off"' not in server.log()
        assert grpc.get_log_settings(as_json=True)["settings"]["log_info"] == {"bool_param": False}
    finally:
        http.update_log_settings({"log_verbose_level": 0, "log_info": True})
    refused = httpx.post(f"{server.url}/v2/logging", json={"log_file": "/tmp/x"}, timeout=10)
    assert refused.status_code == 501
    assert "log file location can not be updated through network protocol" in refused.text
    unknown = httpx.post(f"{server.url}/v2/logging", json={"log_colour": True}, timeout=10)
    assert unknown.status_code == 400 and "unknown log setting 'log_colour'" in unknown.text


def test_metadata_lists_trace_logging_and_sequences(server: Server) -> None:
    listed = {"trace", "logging", "sequence", "model_repository(unload_dependents)"}
    assert listed <= set(httpx.get(f"{server.url}/v2", timeout=10).json()["extensions"])
    assert listed <= set(_grpc(server).get_server_metadata().extensions)


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: each POSTed ExportTraceServiceRequest's spans kept."""

    spans: list = []  # noqa: RUF012 (one list for the test's one collector)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                type(self).spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    _Collector.spans = []
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    finally:
        receiver.shutdown()
        receiver.server_close()


def test_traces_go_to_an_otlp_collector_under_the_caller_s_parent(
    tmp_path: Path, collector: str
) -> None:
    env = {
        "NOGRAD_MODEL_REPOSITORY": str(_repository(tmp_path)),
        "NOGRAD_GRPC_PORT": str(free_port()),
        "NOGRAD_TRACE_MODE": "opentelemetry",
        "NOGRAD_OTLP_ENDPOINT": collector,
        "NOGRAD_OTLP_EXPORT_DELAY_MS": "100",
        "NOGRAD_TRACE_LEVEL": "TIMESTAMPS",
        "NOGRAD_TRACE_RATE": "1",
    }
    with run_server(tmp_path, env=env, ready_timeout_s=120) as running:
        setting = _http(running).get_trace_settings()
        assert setting["trace_mode"] == "opentelemetry" and setting["url"] == collector
        assert "trace_file" not in setting
        _http_infer(_http(running), {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"})
        grpc_parent = f"00-{TRACE_ID}-{'1' * 16}-01"
        _grpc_infer(_grpc(running), {"traceparent": grpc_parent})
        chain_parent = f"00-{CHAIN_TRACE_ID}-{PARENT_SPAN}-01"
        _http_infer(_http(running), {"traceparent": chain_parent}, model="simple_chain")
        deadline = time.monotonic() + 15
        while len(_Collector.spans) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
    spans = [s for s in _Collector.spans if s.trace_id.hex() == TRACE_ID]
    requests = [s for s in spans if s.name == "InferRequest"]
    assert sorted(s.parent_span_id.hex() for s in requests) == sorted([PARENT_SPAN, "1" * 16])
    models = [s for s in spans if s.name == "simple"]
    assert {s.parent_span_id for s in models} == {s.span_id for s in requests}
    # Triton's events: the request's on the model's span, the compute's on its compute span.
    assert [e.name for e in models[0].events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    computes = [s for s in spans if s.name == "compute"]
    assert {s.parent_span_id for s in computes} == {s.span_id for s in models}
    assert [e.name for e in computes[0].events] == ["COMPUTE_START", "COMPUTE_END"]
    assert len(spans) == 6

    # An ensemble: its span inside the request's, a span per step inside it, each computing.
    chain = [s for s in _Collector.spans if s.trace_id.hex() == CHAIN_TRACE_ID]
    names = {s.span_id: s.name for s in chain}
    nesting = sorted((names.get(s.parent_span_id, "-"), s.name) for s in chain)
    assert nesting == [
        ("-", "InferRequest"),
        ("InferRequest", "simple_chain"),
        ("simple", "compute"),
        ("simple", "compute"),
        ("simple_chain", "simple"),
        ("simple_chain", "simple"),
    ]
    (ensemble,) = [s for s in chain if s.name == "simple_chain"]
    assert [e.name for e in ensemble.events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    attributes = {a.key: a.value for a in ensemble.attributes}
    assert attributes["triton.trace_parent_id"].int_value == 0
    for step in (s for s in chain if s.name == "simple"):
        step_attributes = {a.key: a.value for a in step.attributes}
        parent_id = step_attributes["triton.trace_parent_id"].int_value
        assert parent_id == attributes["triton.trace_id"].int_value
        assert step_attributes["triton.model_version"].int_value == 1
