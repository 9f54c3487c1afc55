"""The calls a TorchServe user makes against the archives of ``tests/torchserve_archives.py``,
and how an answer is compared with the one TorchServe gave: the same list is sent to real
TorchServe by ``scripts/record_torchserve_answers.py`` (its answers are kept in
``tests/fixtures/torchserve/answers.json``) and to nograd by the e2e tests."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from tests.torchserve_archives import DIGITS, FIXTURES, KITTEN

ANSWERS = FIXTURES / "answers.json"
TOLERANCE = 1e-5

Compare = Literal["exact", "rows", "description"]
DESCRIPTION_KEYS = (
    "modelName",
    "modelVersion",
    "modelUrl",
    "minWorkers",
    "maxWorkers",
    "batchSize",
    "maxBatchDelay",
    "responseTimeout",
)
"""What ``GET /models/{m}`` must repeat exactly; the rest (workers' pids, start times, memory,
queue counts) is the moment's state."""


@dataclass(frozen=True)
class Exchange:
    """One call: on TorchServe's inference or management API (one port in nograd)."""

    name: str
    method: str
    path: str
    api: Literal["inference", "management"] = "inference"
    content: bytes | None = None
    json_body: Any = None
    files: dict[str, tuple[str, bytes, str]] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    compare: Compare = "exact"


FORM = "multipart/form-data; boundary=b"
PARTS = (
    b'--b\r\nContent-Disposition: form-data; name="f"; filename="a.json"\r\n\r\n{"a": 1}\r\n'
    b'--b\r\nContent-Disposition: form-data; name="j"; filename="j.json"\r\n'
    b'Content-Type: application/json; charset=utf-8\r\n\r\n{"a": 1}\r\n'
    b'--b\r\nContent-Disposition: form-data; name="t"\r\nContent-Type: text/plain\r\n\r\nhi\r\n'
    b"--b--\r\n"
)
"""A form of a file part with no content type, one with its own, and a plain field with one."""
URLENCODED = {"Content-Type": "application/x-www-form-urlencoded"}


def _headers(name: str, content: bytes, content_type: str | None = None) -> Exchange:
    """A prediction of ``headers.mar``, which answers each input's type and headers."""
    sent = {} if content_type is None else {"Content-Type": content_type}
    return Exchange(
        f"headers-{name}", "POST", "/predictions/headers", content=content, headers=sent
    )


EXCHANGES: tuple[Exchange, ...] = (
    Exchange("ping", "GET", "/ping"),
    *(
        Exchange(f"mnist-put-{name}", "PUT", "/predictions/mnist", content=image)
        for name, image in DIGITS.items()
    ),
    Exchange("mnist-post-version", "POST", "/predictions/mnist/1.0", content=DIGITS["7"]),
    Exchange(
        "mnist-form",
        "POST",
        "/predictions/mnist",
        files={"data": ("1.png", DIGITS["1"], "image/png")},
    ),
    Exchange("classifier-kitten", "PUT", "/predictions/classifier", content=KITTEN),
    Exchange(
        "classifier-kitten-form",
        "POST",
        "/predictions/classifier",
        files={"data": ("kitten_small.jpg", KITTEN, "image/jpeg")},
    ),
    Exchange("segment-kitten", "PUT", "/predictions/segment", content=KITTEN),
    Exchange("describe-segment", "GET", "/models/segment", api="management", compare="description"),
    Exchange("scale-json", "POST", "/predictions/scale", json_body={"x": [1.0, 2.0, 3.0, 4.0]}),
    Exchange("scale-prediction-exception", "POST", "/predictions/scale", content=b"not json"),
    Exchange("lazy-json", "POST", "/predictions/lazy", json_body={"text": "first"}),
    Exchange(
        "lazy-text",
        "POST",
        "/predictions/lazy",
        content=b"plain words",
        headers={"Content-Type": "text/plain"},
    ),
    Exchange("unknown-model", "POST", "/predictions/nope", content=b"x"),
    Exchange("unknown-version", "POST", "/predictions/mnist/9.9", content=DIGITS["0"]),
    Exchange("models", "GET", "/models", api="management", compare="rows"),
    Exchange("describe-mnist", "GET", "/models/mnist", api="management", compare="description"),
    Exchange(
        "describe-classifier",
        "GET",
        "/models/classifier",
        api="management",
        compare="description",
    ),
    Exchange("describe-unknown", "GET", "/models/nope", api="management"),
    # Each input's own headers (context.get_request_header(i, name)) and value type.
    Exchange(
        "headers-png-query",
        "PUT",
        "/predictions/headers?k=v",
        content=DIGITS["0"],
        headers={"Content-Type": "image/png"},
    ),
    _headers("json-charset", b'{"a": 1}', "application/json; charset=utf-8"),
    _headers("json-capitals", b'{"a": 1}', "Application/JSON"),
    _headers("text", b"words", "text/plain"),
    _headers("raw", b"raw"),
    Exchange(
        "headers-form-file",
        "POST",
        "/predictions/headers",
        files={"data": ("1.png", DIGITS["1"], "image/png")},
    ),
    _headers("form-parts", PARTS, FORM),
    _headers("urlencoded", b"a=1&b=%C3%A9+x", URLENCODED["Content-Type"]),
    Exchange(
        "headers-frontend-headers",
        "POST",
        "/predictions/headers/1.0",
        content=b"x",
        headers={"explain": "True", "url_path": "p"},
    ),
    # A handler's failures: a PredictionException's status (413 sent as 507), any other 503.
    *(
        _headers(f"status-{status}", f"status={status}".encode(), URLENCODED["Content-Type"])
        for status in ("400", "413", "503", "nan")
    ),
)


def send(client: httpx.Client, base: dict[str, str], exchange: Exchange) -> dict[str, Any]:
    """The answer as it is recorded: status, media type, and the body (JSON when it parses)."""
    response = client.request(
        exchange.method,
        base[exchange.api] + exchange.path,
        content=exchange.content,
        json=exchange.json_body,
        files=exchange.files or None,
        headers=exchange.headers,
    )
    media = response.headers.get("content-type", "").split(";")[0].strip()
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return {"status": response.status_code, "media": media, "body": body}


def close(expected: Any, got: Any, where: str = "body") -> list[str]:
    """Where ``got`` differs from ``expected``: floats within TOLERANCE, all else exact."""
    if isinstance(expected, float) or isinstance(got, float):
        numbers = isinstance(expected, int | float) and isinstance(got, int | float)
        if numbers and math.isclose(expected, got, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
            return []
        return [f"{where}: {got!r} != {expected!r}"]
    if isinstance(expected, dict) and isinstance(got, dict):
        # JSON objects: the same keys and values, in any order.
        if sorted(expected) != sorted(got):
            return [f"{where}: keys {sorted(got)} != {sorted(expected)}"]
        return [d for key in expected for d in close(expected[key], got[key], f"{where}.{key}")]
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return [f"{where}: {len(got)} items != {len(expected)}"]
        pairs = enumerate(zip(expected, got, strict=True))
        return [d for i, (e, g) in pairs for d in close(e, g, f"{where}[{i}]")]
    return [] if expected == got else [f"{where}: {got!r} != {expected!r}"]


def differences(exchange: Exchange, recorded: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """How nograd's answer to ``exchange`` differs from TorchServe's recorded one."""
    found = close(recorded["status"], got["status"], "status")
    found += close(recorded["media"], got["media"], "media")
    expected, body = recorded["body"], got["body"]
    if exchange.compare == "exact":
        return found + close(expected, body)
    if exchange.compare == "rows":
        # nograd's repository may list more models (its own folders) beside the archives.
        rows = body.get("models", []) if isinstance(body, dict) else []
        return found + [f"body: row {row} missing" for row in expected["models"] if row not in rows]
    if not (isinstance(body, list) and len(body) == len(expected) == 1):
        return [*found, f"body: {body!r} is not one description"]
    missing = sorted(set(expected[0]) - set(body[0]))
    found += [f"body: keys {missing} missing"] if missing else []
    return found + [
        d for key in DESCRIPTION_KEYS for d in close(expected[0][key], body[0].get(key), key)
    ]


def recorded_answers(path: Path = ANSWERS) -> dict[str, dict[str, Any]]:
    return dict(json.loads(path.read_text("utf-8"))["answers"])
