"""The calls a Triton user makes against the Python-backend models and ensembles of
``tests/triton_models.py``, and how an answer is compared with Triton's: the same list is sent to
Triton Inference Server by ``scripts/record_triton_answers.py`` (its answers are kept in
``tests/fixtures/triton/answers.json``) and to nograd by the e2e tests, over HTTP (the body as
JSON) and gRPC (tritonclient's calls, the messages as JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import tritonclient.grpc as triton_grpc
from google.protobuf.json_format import MessageToDict
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from tests.torchserve_exchanges import close
from tests.triton_models import FIXTURES

ANSWERS = FIXTURES / "answers.json"
COMPARED = (
    "add_sub",
    "pytorch",
    "simple_identity",
    "guarded",
    "guarded_twice",
    "chain",
    "warmed",
    "optional_sum",
    "tally",
    "tally_named",
    "tally_string_corrid",
)
"""The models both servers load: Python-backend models and ensembles of them (the Triton build
that records runs the Python backend only)."""

Api = Literal["http", "grpc"]


@dataclass(frozen=True)
class Exchange:
    """One call, over HTTP (method, path, JSON body) or gRPC (a tritonclient call)."""

    name: str
    api: Api
    method: str
    path: str = ""
    body: Any = None
    model: str = ""
    inputs: tuple[tuple[str, str, tuple[Any, ...]], ...] = ()
    sequence: tuple[tuple[str, Any], ...] = ()
    """A gRPC call's sequence arguments (tritonclient's ``sequence_id``, ``sequence_start``,
    ``sequence_end``)."""


def _tensor(name: str, datatype: str, rows: list[Any]) -> dict[str, Any]:
    array = np.array(rows)
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": rows}


def _infer(model: str, version: str = "") -> str:
    return f"/v2/models/{model}{f'/versions/{version}' if version else ''}/infer"


def _step(
    name: str,
    api: Api,
    model: str,
    rows: tuple[int, ...],
    sequence_id: int | str | None,
    start: bool = False,
    end: bool = False,
) -> Exchange:
    """One request of a sequence: ``INPUT`` holds ``rows`` (one value each); ``sequence_id``
    None sends no sequence parameters at all."""
    sequence: dict[str, Any] = {}
    if sequence_id is not None:
        sequence["sequence_id"] = sequence_id
        sequence.update({"sequence_start": True} if start else {})
        sequence.update({"sequence_end": True} if end else {})
    values = tuple((value,) for value in rows)
    if api == "grpc":
        inputs = (("INPUT", "INT32", values),)
        return Exchange(
            name, api, "infer", model=model, inputs=inputs, sequence=(*sequence.items(),)
        )
    body = {"inputs": [_tensor("INPUT", "INT32", [list(row) for row in values])]}
    return Exchange(name, api, "POST", _infer(model), {**body, "parameters": sequence})


SEQUENCE_EXCHANGES: tuple[Exchange, ...] = tuple(
    exchange
    for api, (first, second), (named_first, named_second) in (
        ("http", (101, 102), ("alpha", "beta")),
        ("grpc", (201, 202), ("gamma", "delta")),
    )
    for exchange in (
        # Two sequences interleaved, each ended; its id continued after its end.
        _step(f"{api}-sequence-start", api, "tally", (5,), first, start=True),
        _step(f"{api}-sequence-start-other", api, "tally", (100,), second, start=True),
        _step(f"{api}-sequence-continue", api, "tally", (2,), first),
        _step(f"{api}-sequence-end-other", api, "tally", (1,), second, end=True),
        _step(f"{api}-sequence-end", api, "tally", (3,), first, end=True),
        _step(f"{api}-sequence-after-end", api, "tally", (1,), first),
        _step(f"{api}-sequence-start-and-end", api, "tally", (9,), first, start=True, end=True),
        # String ids (a model without a CORRID control keys its sums by correlation_id()).
        _step(f"{api}-sequence-named-start", api, "tally_named", (4,), named_first, start=True),
        _step(f"{api}-sequence-named-other", api, "tally_named", (1,), named_second, start=True),
        _step(f"{api}-sequence-named-number", api, "tally_named", (8,), first, start=True),
        _step(f"{api}-sequence-named-end", api, "tally_named", (6,), named_first, end=True),
        _step(f"{api}-sequence-named-end-other", api, "tally_named", (2,), named_second, end=True),
        _step(f"{api}-sequence-named-after-end", api, "tally_named", (1,), named_first),
        _step(f"{api}-sequence-named-number-end", api, "tally_named", (1,), first, end=True),
        # Refused: no START first, no id, two rows.
        _step(f"{api}-sequence-unknown", api, "tally", (1,), 999),
        _step(f"{api}-sequence-no-id", api, "tally", (1,), None),
        _step(f"{api}-sequence-zero-id", api, "tally", (1,), 0, start=True),
        _step(f"{api}-sequence-empty-id", api, "tally_named", (1,), "", start=True),
        _step(f"{api}-sequence-two-rows", api, "tally", (1, 2), first + 10, start=True),
    )
)
"""Sequences over HTTP and gRPC, in the order they are sent (each depends on the ones before).

Left out, where nograd answers otherwise on purpose: a sequence id sent to a model without
``sequence_batching`` (Triton 2.51 serves the request as if no id were sent, 200; nograd never
silently ignores a field a client sent, so it refuses, 400), and a string id to a model whose
CORRID control is a number (Triton feeds the model the string's serialized bytes read as that
number; nograd refuses, 400, naming the CORRID's type). Requests to a model whose CORRID is a
string are left out too: Triton 2.51 refuses them all ('unexpected number of string elements 2
for inference input 'CORRID', expecting 1'), where nograd feeds the id as the string it is."""

EXCHANGES: tuple[Exchange, ...] = (
    *(Exchange(f"http-metadata-{m}", "http", "GET", f"/v2/models/{m}") for m in COMPARED),
    *(Exchange(f"http-config-{m}", "http", "GET", f"/v2/models/{m}/config") for m in COMPARED),
    *(Exchange(f"http-ready-{m}", "http", "GET", f"/v2/models/{m}/ready") for m in COMPARED),
    Exchange(
        "http-infer-add_sub",
        "http",
        "POST",
        _infer("add_sub"),
        {
            "inputs": [
                _tensor("INPUT0", "FP32", [1.0, 2.0, 3.0, 4.0]),
                _tensor("INPUT1", "FP32", [0.5, 0.25, 0.125, 2.0]),
            ]
        },
    ),
    Exchange(
        "http-infer-pytorch",
        "http",
        "POST",
        _infer("pytorch"),
        {
            "inputs": [
                _tensor("INPUT0", "FP32", [1.0, 2.0, 3.0, 4.0]),
                _tensor("INPUT1", "FP32", [0.5, 0.25, 0.125, 2.0]),
            ],
            "outputs": [{"name": "OUTPUT1"}],
        },
    ),
    Exchange(
        "http-infer-identity",
        "http",
        "POST",
        _infer("simple_identity"),
        {"inputs": [_tensor("INPUT0", "BYTES", [["hello", "nograd"], ["a", "b"]])], "id": "7"},
    ),
    Exchange(
        "http-infer-guarded-v1",
        "http",
        "POST",
        _infer("guarded", version="1"),
        {"inputs": [_tensor("X", "FP32", [[1.5, 0.0], [2.0, 0.0]])]},
    ),
    Exchange(
        "http-infer-guarded-negative",
        "http",
        "POST",
        _infer("guarded"),
        {"inputs": [_tensor("X", "FP32", [[-1.0, 0.0]])]},
    ),
    Exchange(
        "http-infer-guarded-too-large",
        "http",
        "POST",
        _infer("guarded"),
        {"inputs": [_tensor("X", "FP32", [[5000.0, 0.0]])]},
    ),
    Exchange(
        "http-infer-guarded_twice",
        "http",
        "POST",
        _infer("guarded_twice"),
        {"inputs": [_tensor("X", "FP32", [[0.25, 0.0], [3.0, 1.0]])]},
    ),
    Exchange(
        "http-infer-chain",
        "http",
        "POST",
        _infer("chain"),
        {
            "inputs": [
                _tensor("A", "FP32", [1.0, 2.0, 3.0, 4.0]),
                _tensor("B", "FP32", [10.0, 20.0, 30.0, 40.0]),
            ]
        },
    ),
    Exchange(
        "http-infer-optional-left-out",
        "http",
        "POST",
        _infer("optional_sum"),
        {"inputs": [_tensor("A", "FP32", [[1.0, 2.0]])]},
    ),
    Exchange(
        "http-infer-unknown-model",
        "http",
        "POST",
        _infer("nope"),
        {"inputs": [_tensor("X", "FP32", [[1.0, 2.0]])]},
    ),
    Exchange(
        "http-infer-unknown-input",
        "http",
        "POST",
        _infer("add_sub"),
        {"inputs": [_tensor("NOPE", "FP32", [1.0, 2.0, 3.0, 4.0])]},
    ),
    Exchange(
        "http-infer-missing-input",
        "http",
        "POST",
        _infer("add_sub"),
        {"inputs": [_tensor("INPUT0", "FP32", [1.0, 2.0, 3.0, 4.0])]},
    ),
    Exchange(
        "http-infer-wrong-shape",
        "http",
        "POST",
        _infer("add_sub"),
        {
            "inputs": [
                _tensor("INPUT0", "FP32", [1.0, 2.0, 3.0, 4.0]),
                _tensor("INPUT1", "FP32", [1.0, 2.0, 3.0]),
            ]
        },
    ),
    Exchange(
        "http-infer-wrong-shape-batched",
        "http",
        "POST",
        _infer("guarded"),
        {"inputs": [_tensor("X", "FP32", [[1.0, 2.0, 3.0]])]},
    ),
    Exchange(
        "http-infer-unexpected-input",
        "http",
        "POST",
        _infer("add_sub"),
        {
            "inputs": [
                _tensor("INPUT0", "FP32", [1.0, 2.0, 3.0, 4.0]),
                _tensor("NOPE", "FP32", [1.0, 2.0, 3.0, 4.0]),
            ]
        },
    ),
    Exchange(
        "http-infer-wrong-datatype",
        "http",
        "POST",
        _infer("add_sub"),
        {
            "inputs": [
                _tensor("INPUT0", "INT32", [1, 2, 3, 4]),
                _tensor("INPUT1", "FP32", [1.0, 2.0, 3.0, 4.0]),
            ]
        },
    ),
    Exchange("http-metadata-unknown", "http", "GET", "/v2/models/nope"),
    Exchange("http-metadata-unknown-version", "http", "GET", "/v2/models/guarded/versions/9"),
    *(Exchange(f"grpc-metadata-{m}", "grpc", "metadata", model=m) for m in COMPARED),
    *(Exchange(f"grpc-config-{m}", "grpc", "config", model=m) for m in COMPARED),
    Exchange(
        "grpc-infer-add_sub",
        "grpc",
        "infer",
        model="add_sub",
        inputs=(("INPUT0", "FP32", (1.0, 2.0, 3.0, 4.0)), ("INPUT1", "FP32", (4.0, 3.0, 2.0, 1.0))),
    ),
    Exchange(
        "grpc-infer-identity",
        "grpc",
        "infer",
        model="simple_identity",
        inputs=(("INPUT0", "BYTES", (("x", "yz"),)),),
    ),
    Exchange(
        "grpc-infer-guarded-negative",
        "grpc",
        "infer",
        model="guarded",
        inputs=(("X", "FP32", ((-1.0, 0.0),)),),
    ),
    Exchange(
        "grpc-infer-guarded_twice",
        "grpc",
        "infer",
        model="guarded_twice",
        inputs=(("X", "FP32", ((0.25, 0.0),)),),
    ),
    Exchange(
        "grpc-infer-unknown-model",
        "grpc",
        "infer",
        model="nope",
        inputs=(("X", "FP32", ((1.0, 2.0),)),),
    ),
    *SEQUENCE_EXCHANGES,
)


def send_http(client: httpx.Client, url: str, exchange: Exchange) -> dict[str, Any]:
    """Status and body (JSON when it parses; an empty body as "")."""
    response = client.request(exchange.method, url + exchange.path, json=exchange.body)
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return {"status": response.status_code, "body": body}


def send_grpc(client: triton_grpc.InferenceServerClient, exchange: Exchange) -> dict[str, Any]:
    """The answer as JSON: the message (metadata, config, the outputs as lists) or the error's
    status code and message."""
    try:
        if exchange.method == "metadata":
            return {"body": MessageToDict(client.get_model_metadata(exchange.model))}
        if exchange.method == "config":
            return {"body": MessageToDict(client.get_model_config(exchange.model))}
        inputs = []
        for name, datatype, rows in exchange.inputs:
            array = np.array(rows, dtype=triton_to_np_dtype(datatype))
            tensor = triton_grpc.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(exchange.model, inputs, **dict(exchange.sequence))
        response = result.get_response()
        outputs = {}
        for output in response.outputs:
            array = result.as_numpy(output.name)
            values = [v.decode() if isinstance(v, bytes) else v for v in array.flatten().tolist()]
            outputs[output.name] = {
                "datatype": output.datatype,
                "shape": list(output.shape),
                "data": values,
            }
        return {"body": {"model_name": response.model_name, "outputs": outputs}}
    except InferenceServerException as exc:
        return {"error": {"status": exc.status(), "message": exc.message()}}


def _by_name(answer: Any) -> Any:
    """An answer with its outputs in name order: clients find an output by its name, and the
    order of an ensemble's outputs is Triton's map order."""
    body = answer.get("body") if isinstance(answer, dict) else None
    outputs = body.get("outputs") if isinstance(body, dict) else None
    if not isinstance(outputs, list):
        return answer
    ordered = sorted(outputs, key=lambda output: str(output.get("name")))
    return {**answer, "body": {**body, "outputs": ordered}}


def differences(recorded: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """How nograd's answer differs from Triton's: every field, floats within 1e-5."""
    return close(_by_name(recorded), _by_name(got), "answer")


def recorded_answers(path: Path = ANSWERS) -> dict[str, dict[str, Any]]:
    return dict(json.loads(path.read_text("utf-8"))["answers"])
