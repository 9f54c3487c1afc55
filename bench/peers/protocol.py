"""How the load generator talks to each peer: the route, and the workload's bodies in its format.

Every body a peer receives is built from the workload's own V2 body (``bench/workloads.py``: same
seed, same sentences, same images, same order), so every system answers the same requests:

- ``v2``: the workload's body unchanged (nograd, TorchServe, Triton's digits);
- ``v2-column``: the same V2 body with a text tensor's shape ``[n]`` written ``[n, 1]``: Triton
  with a dynamic batcher wants the batch dimension in front of every input's declared shape, and
  a BYTES input cannot be declared with no dimension at all (``dims`` must not be empty);
- ``openai``: ``{"model": "minilm", "input": [texts]}`` for infinity's ``POST /embeddings``.

The files are laid out as ``Workload.write_bodies`` does (one body per line), for ``post.lua``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import orjson

from bench.workloads import Workload

BodyFormat = Literal["v2", "v2-column", "openai"]
BODY_FORMATS: Final[tuple[BodyFormat, ...]] = ("v2", "v2-column", "openai")
MODEL_OF_WORKLOAD: Final = {"digits": "digits", "minilm-1": "minilm", "minilm-8": "minilm"}


@dataclass(frozen=True)
class Route:
    """Where and in which format a workload's requests go for one peer system."""

    path: str
    body_format: BodyFormat


def route(system: str, workload: str) -> Route:
    """The route of ``workload`` on peer ``system`` (``pytriton``, ``torchserve``,
    ``infinity-torch``, ``infinity-onnx``); ValueError for a pair the peer does not serve."""
    model = MODEL_OF_WORKLOAD.get(workload)
    if model is None:
        raise ValueError(f"unknown workload {workload!r}")
    if system == "pytriton":
        return Route(f"/v2/models/{model}/infer", "v2-column" if model == "minilm" else "v2")
    if system == "torchserve":
        # TorchServe 0.12's frontend routes the KServe V2 path to the model's handler.
        return Route(f"/v2/models/{model}/infer", "v2")
    if system in ("infinity-torch", "infinity-onnx"):
        if model != "minilm":
            raise ValueError(f"{system} serves embeddings only, not {workload!r}")
        return Route("/embeddings", "openai")
    raise ValueError(f"unknown peer system {system!r}")


def convert_body(body: bytes, body_format: BodyFormat, model: str = "minilm") -> bytes:
    """One V2 request body in ``body_format``."""
    if body_format == "v2":
        return body
    document: dict[str, Any] = orjson.loads(body)
    tensor = document["inputs"][0]
    if body_format == "v2-column":
        if tensor["datatype"] == "BYTES" and len(tensor["shape"]) == 1:
            tensor["shape"] = [tensor["shape"][0], 1]
        return orjson.dumps(document)
    if body_format == "openai":
        if tensor["datatype"] != "BYTES":
            raise ValueError("only text inputs have an OpenAI embeddings body")
        return orjson.dumps({"model": model, "input": [str(text) for text in tensor["data"]]})
    raise ValueError(f"unknown body format {body_format!r}")


def peer_bodies(workload: Workload, body_format: BodyFormat) -> tuple[bytes, ...]:
    return tuple(convert_body(body, body_format, workload.model) for body in workload.bodies)


def write_peer_bodies(workload: Workload, body_format: BodyFormat, directory: Path) -> Path:
    """The workload's bodies in ``body_format``, one per line, where ``post.lua`` reads them."""
    if body_format == "v2":
        return workload.write_bodies(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"bodies-{workload.name}-{body_format}.txt"
    path.write_bytes(b"\n".join(peer_bodies(workload, body_format)) + b"\n")
    return path


def request_texts(body: bytes) -> list[str]:
    """The texts a V2 text body carries (for the answer check's reference)."""
    document: dict[str, Any] = orjson.loads(body)
    return [str(text) for text in document["inputs"][0]["data"]]


def request_images(body: bytes) -> np.ndarray:
    """The ``[n, 1, 8, 8]`` images a V2 digits body carries."""
    tensor = orjson.loads(body)["inputs"][0]
    return np.asarray(tensor["data"], dtype=np.float32).reshape([-1, 1, 8, 8])


def answer_outputs(answer: bytes) -> dict[str, np.ndarray]:
    """A V2 answer's outputs as arrays of their declared shapes."""
    document: dict[str, Any] = orjson.loads(answer)
    outputs: dict[str, np.ndarray] = {}
    for output in document["outputs"]:
        dtype = np.int64 if output["datatype"].startswith(("INT", "UINT")) else np.float64
        outputs[output["name"]] = np.asarray(output["data"], dtype=dtype).reshape(output["shape"])
    return outputs


def answer_embeddings(answer: bytes, body_format: BodyFormat) -> np.ndarray:
    """``[n, 384]`` embeddings from a V2 answer (output ``embedding``) or an OpenAI one
    (``data[i].embedding``, put back in ``index`` order)."""
    if body_format == "openai":
        rows = sorted(orjson.loads(answer)["data"], key=lambda item: int(item["index"]))
        return np.asarray([row["embedding"] for row in rows], dtype=np.float64)
    return answer_outputs(answer)["embedding"]
