"""Pydantic shapes of the V2 documents, for a truthful OpenAPI schema.

The infer route parses its body with orjson and validates by hand (a pydantic pass over large
tensors would double the decode cost), so its request schema is attached with ``openapi_extra``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from nograd.core.datatypes import Datatype


class ErrorResponse(BaseModel):
    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class LiveResponse(BaseModel):
    live: bool


class ReadyResponse(BaseModel):
    ready: bool


class ModelReadyResponse(BaseModel):
    name: str
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(description="Full shape, batch dimension first.")
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] = Field(description="Row-major data, flat or nested.")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequestDocument(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any]


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class DurationStat(BaseModel):
    count: int = Field(description="Times the duration was recorded.")
    ns: int = Field(description="Total duration, nanoseconds.")


class InferenceStats(BaseModel):
    success: DurationStat = Field(description="Requests that succeeded: count and total time.")
    fail: DurationStat = Field(description="Requests that failed: count and total time.")
    queue: DurationStat = Field(description="Per request: time waiting for its batch to start.")
    compute_input: DurationStat = Field(description="Included in compute_infer (ns is 0).")
    compute_infer: DurationStat = Field(
        description="Per request: time of its batch on the device (collate, forward, copy back)."
    )
    compute_output: DurationStat = Field(description="Included in compute_infer (ns is 0).")
    cache_hit: DurationStat
    cache_miss: DurationStat


class BatchStats(BaseModel):
    batch_size: int
    compute_input: DurationStat
    compute_infer: DurationStat = Field(description="Batches of this size: count and total time.")
    compute_output: DurationStat


class ModelStats(BaseModel):
    name: str
    version: str
    last_inference: int = Field(description="Time of the last request, ms since the epoch.")
    inference_count: int = Field(description="Samples (rows) of successful requests.")
    execution_count: int = Field(description="Successful batches run on the device.")
    inference_stats: InferenceStats
    batch_stats: list[BatchStats]


class StatisticsResponse(BaseModel):
    model_stats: list[ModelStats]


class RepositoryIndexEntry(BaseModel):
    name: str
    version: str | None = None
    """Absent for a model of the repository that is not loaded."""
    state: str
    reason: str | None = None


class RepositoryIndexRequest(BaseModel):
    ready: bool | None = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Malformed request or wrong input"},
    404: {"model": ErrorResponse, "description": "Unknown model or version"},
    503: {"model": ErrorResponse, "description": "Model not ready, draining, or queue full"},
    504: {"model": ErrorResponse, "description": "Deadline passed while queued"},
    507: {"model": ErrorResponse, "description": "One sample does not fit in device memory"},
}

INFER_REQUEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": InferRequestDocument.model_json_schema()},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "Binary tensor data extension: the JSON request (its length in "
                "the Inference-Header-Content-Length header), then the raw bytes of every input "
                "whose parameters give binary_data_size, in order.",
            },
        },
    }
}
