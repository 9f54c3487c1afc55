"""TorchServe handler for the peer benchmark: the KServe V2 JSON body in, the V2 JSON answer out.

Packed into the model archive by ``torchserve_server.py`` beside ``peer_models.py`` and
``peer_model.json`` (which model, and where its weights are). TorchServe batches whole requests
(``batchSize`` / ``maxBatchDelay``): one call gets up to ``batchSize`` request bodies, which are
concatenated into one forward and cut back into one answer per request by their row counts, so a
request of eight sentences gets its eight rows. A body that cannot be read fails its own request
only: the answer at its position is a 400 with the error document.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np


def _import_beside(model_dir: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ts_{name}", model_dir / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


READY_ANSWER: Final = b'{"ready":true}'


def _is_probe(request: dict[str, Any]) -> bool:
    """A request without a body (``GET /predictions/<model>``): the bench's readiness probe,
    answered by a worker, so a 200 means the model is loaded (TorchServe's ``/ping`` is healthy
    before the model is even registered)."""
    body = request.get("body", request.get("data"))
    return body is None or body == b"" or body == ""


def _document(request: dict[str, Any]) -> dict[str, Any]:
    """TorchServe hands a JSON body over already parsed, other bodies as bytes."""
    body = request.get("body", request.get("data"))
    if isinstance(body, bytes | bytearray):
        body = json.loads(body)
    if not isinstance(body, dict) or not body.get("inputs"):
        raise ValueError("expected a KServe V2 body with 'inputs'")
    return body


def _v2_answer(model: str, outputs: dict[str, np.ndarray], datatypes: dict[str, str]) -> bytes:
    document = {
        "model_name": model,
        "model_version": "1",
        "outputs": [
            {
                "name": name,
                "datatype": datatypes[name],
                "shape": list(array.shape),
                "data": array.reshape(-1).tolist(),
            }
            for name, array in outputs.items()
        ],
    }
    return json.dumps(document, separators=(",", ":")).encode()


class PeerHandler:
    """Loads the model named in ``peer_model.json`` once per worker and serves V2 batches."""

    def __init__(self) -> None:
        self.model_name = ""
        self.model: Any = None
        self.peer_models: ModuleType | None = None

    def initialize(self, context: Any) -> None:
        model_dir = Path(context.system_properties["model_dir"])
        settings = json.loads((model_dir / "peer_model.json").read_text("utf-8"))
        self.peer_models = _import_beside(model_dir, "peer_models")
        self.model_name = str(settings["model"])
        weights = Path(settings["model_dir"])
        if self.model_name == "minilm":
            self.model = self.peer_models.MiniLMModel(weights)
        else:
            self.model = self.peer_models.DigitsModel(weights)

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        parsed: list[Any] = []
        answers: list[bytes | None] = []
        for index, request in enumerate(data):
            if _is_probe(request):
                parsed.append(None)
                answers.append(READY_ANSWER)
                continue
            try:
                parsed.append(self._rows(_document(request)))
                answers.append(None)
            except (ValueError, KeyError, TypeError) as exc:
                parsed.append(None)
                answers.append(json.dumps({"error": str(exc)}).encode())
                context.set_response_status(400, "Bad Request", idx=index)
        good = [rows for rows in parsed if rows is not None]
        outputs = self._forward(good) if good else {}
        start = 0
        for index, rows in enumerate(parsed):
            context.set_response_content_type(index, "application/json")
            if rows is None:
                continue
            count = len(rows)
            piece = {name: array[start : start + count] for name, array in outputs.items()}
            answers[index] = _v2_answer(self.model_name, piece, self._datatypes())
            start += count
        return [answer or b"" for answer in answers]

    def _rows(self, document: dict[str, Any]) -> Any:
        tensor = document["inputs"][0]
        if self.model_name == "minilm":
            assert self.peer_models is not None
            texts: list[str] = self.peer_models.texts_of(tensor["data"])
            return texts
        data = np.asarray(tensor["data"], dtype=np.float32)
        return data.reshape([-1, 1, 8, 8])

    def _forward(self, batches: list[Any]) -> dict[str, np.ndarray]:
        if self.model_name == "minilm":
            embedding, counts = self.model.encode([text for rows in batches for text in rows])
            return {"embedding": embedding, "token_count": counts}
        outputs: dict[str, np.ndarray] = self.model.predict(np.concatenate(batches))
        return outputs

    def _datatypes(self) -> dict[str, str]:
        if self.model_name == "minilm":
            return {"embedding": "FP32", "token_count": "INT64"}
        return {"logits": "FP32", "probabilities": "FP32", "label": "INT64"}


_service = PeerHandler()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[bytes] | None:
    """TorchServe's module-level entry point: called with ``None`` once to initialise."""
    if _service.model is None:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
