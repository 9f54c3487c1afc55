"""OpenAI-compatible routes: ``POST /v1/embeddings`` and ``GET /v1/models``. Thin, like V2.

Any served model with one BYTES input (texts; per-sample shape ``[]`` or ``[1]``) and one FP32
vector output is an embeddings model. When it also has an INT64 ``[1]`` output named
``token_count``, usage reports those counts; otherwise usage is 0. An embedding holding NaN or
+/-Inf is the model failing (500 naming the model), never a vector of nulls. Errors use
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so the ``openai`` SDK raises
its own exceptions (``BadRequestError``, ``NotFoundError``, ...).
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nograd.http.error_bodies import error_headers, openai_error_body
from nograd.http.exchange import Incoming, parse_measured, run_call
from nograd.http.reply import Reply
from nograd.http.state import calls_of, dataplane_of
from nograd.serving.calls.lifecycle import Call, Calls
from nograd.serving.errors import InferenceFailed
from nograd.serving.registry import ServedModel

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
PROTOCOL: Final = "openai"
TOKEN_COUNT_OUTPUT: Final = "token_count"
MAX_INPUTS: Final = 2048
"""OpenAI's own cap on texts per request; larger lists are a 400, as there."""


class EmbeddingRequest(BaseModel):
    """The body of ``POST /v1/embeddings``; fields OpenAI may add later are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="Name of a served embeddings model.")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text or a list of texts (token-id arrays are refused)."
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float",
        description="float: JSON numbers; base64: little-endian float32 bytes, base64-encoded.",
    )
    dimensions: int | None = Field(
        default=None, description="Only the model's native dimension is accepted."
    )
    user: str | None = Field(default=None, description="Accepted and ignored.")


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nograd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: ErrorDetail


class _ClientError(Exception):
    """A request OpenAI would refuse; carries the status and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": OpenAIError, "description": "Bad input, or not an embeddings model"},
    404: {"model": OpenAIError, "description": "Unknown model"},
    503: {"model": OpenAIError, "description": "Model not ready, draining, or queue full"},
}


@dataclass(frozen=True)
class _EmbeddingsModel:
    """How to call a served model as an embeddings model."""

    input_name: str
    input_shape: tuple[int, ...]
    output_name: str
    dimensions: int
    counts_tokens: bool


def _as_embeddings_model(model: ServedModel) -> _EmbeddingsModel:
    config = model.config
    vectors = [s for s in config.outputs if s.datatype == "FP32" and len(s.shape) == 1]
    text = config.inputs[0]
    if (
        len(config.inputs) != 1
        or text.datatype != "BYTES"
        or text.shape not in ((), (1,))
        or len(vectors) != 1
        or vectors[0].shape[0] < 1
    ):
        raise _ClientError(
            400,
            f"model {model.name!r} is not an embeddings model: /v1/embeddings needs one BYTES "
            f"text input and one FP32 vector output",
            "model",
        )
    counts_tokens = any(
        s.name == TOKEN_COUNT_OUTPUT and s.datatype == "INT64" and s.shape == (1,)
        for s in config.outputs
    )
    return _EmbeddingsModel(
        text.name, text.shape, vectors[0].name, vectors[0].shape[0], counts_tokens
    )


def _texts(body: EmbeddingRequest) -> list[str]:
    raw = body.input
    if isinstance(raw, str):
        return [raw]
    if raw and not all(isinstance(item, str) for item in raw):
        raise _ClientError(
            400, "token-id input is not supported: send a string or a list of strings", "input"
        )
    if not raw:
        raise _ClientError(400, "input must not be an empty list", "input")
    if len(raw) > MAX_INPUTS:
        raise _ClientError(400, f"input has {len(raw)} texts; at most {MAX_INPUTS}", "input")
    return [item for item in raw if isinstance(item, str)]


def _parse(body: bytes | bytearray | memoryview) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate_json(
            bytes(body) if isinstance(body, memoryview) else body
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise _ClientError(400, f"invalid request: {problems}", param) from exc


def _encode(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector  # orjson writes float32 arrays directly, shortest round-trip form


def _non_finite_message(model: str, vectors: np.ndarray) -> str:
    """A NaN or infinite embedding is the model failing, never a vector to hand out (JSON would
    turn it into nulls a client may not check for)."""
    rows = np.flatnonzero(~np.isfinite(vectors.reshape(len(vectors), -1)).all(axis=1))
    return (
        f"model {model!r} produced a non-finite embedding (NaN or +/-Inf) for input "
        f"{int(rows[0])}" + (f" and {len(rows) - 1} more" if len(rows) > 1 else "")
    )


def _error_reply(
    status: int, message: str, param: str | None = None, exc: BaseException | None = None
) -> Reply:
    body = openai_error_body(status, message, param=param)
    return Reply(status, body, headers=error_headers(status, exc))


async def _embeddings(calls: Calls, call: Call, body: EmbeddingRequest) -> bytes:
    """The response body; raises on any error."""
    texts = _texts(body)
    await calls.resident(call, body.model)
    spec = _as_embeddings_model(calls.served(call, body.model, None))
    if body.dimensions is not None and body.dimensions != spec.dimensions:
        raise _ClientError(
            400,
            f"dimensions={body.dimensions} is not supported by model {body.model!r}; "
            f"it produces {spec.dimensions}",
            "dimensions",
        )
    array = np.empty(len(texts), dtype=np.object_)
    array[:] = [text.encode("utf-8") for text in texts]
    inputs = {spec.input_name: array.reshape((len(texts), *spec.input_shape))}
    model, outputs = await calls.infer(call, body.model, None, inputs)
    vectors = outputs[spec.output_name]
    if not np.isfinite(vectors).all():
        calls.metrics.inference_errors.labels(model.name).inc()
        raise InferenceFailed(_non_finite_message(model.name, vectors))
    tokens = int(outputs[TOKEN_COUNT_OUTPUT].sum()) if spec.counts_tokens else 0
    document = {
        "object": "list",
        "data": [
            {"object": "embedding", "embedding": _encode(vector, body.encoding_format), "index": i}
            for i, vector in enumerate(vectors)
        ],
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


@router.post(
    "/embeddings",
    response_model=EmbeddingResponse,
    summary="Create embeddings (OpenAI-compatible)",
    responses=_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": EmbeddingRequest.model_json_schema()}},
        }
    },
)
async def create_embeddings(request: Request) -> Response:
    incoming = Incoming(request.scope, request.receive)
    reply = await embeddings_call(incoming, calls_of(request))
    return reply.response()


async def embeddings_call(incoming: Incoming, calls: Calls) -> Reply:
    """One embeddings call; served by ``nograd.http.direct`` ahead of the router, and by the
    route."""

    async def work(call: Call) -> Reply:
        body = await parse_measured(calls, call, await incoming.body(), _parse)
        call.model = calls.label(body.model)
        return Reply(200, await _embeddings(calls, call, body))

    def on_error(status: int, exc: Exception) -> Reply:
        param = exc.param if isinstance(exc, _ClientError) else None
        param = param or ("model" if status == 404 else None)
        return _error_reply(status, str(exc), param, exc)

    return await run_call(incoming, calls, PROTOCOL, work, on_error)


def _card(model: ServedModel) -> ModelCard:
    return ModelCard(id=model.name, created=int(model.directory.stat().st_mtime))


@router.get("/models", response_model=ModelList, summary="List models (OpenAI-compatible)")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(m) for m in dataplane_of(request).models.values()])


@router.get(
    "/models/{name}",
    response_model=ModelCard,
    summary="Retrieve a model (OpenAI-compatible)",
    responses={404: {"model": OpenAIError, "description": "Unknown model"}},
)
async def retrieve_model(request: Request, name: str) -> Response:
    model = dataplane_of(request).models.get(name)
    if model is None:
        return _error_reply(404, f"model {name!r} is not in the repository", "model").response()
    return Response(content=_card(model).model_dump_json(), media_type="application/json")
