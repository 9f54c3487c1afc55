"""TorchServe's ``ts.context``: what a handler learns of its model and of each request."""

from __future__ import annotations

from typing import Any


class Metrics:
    """TorchServe's metrics cache, accepted and dropped: nograd exports its own metrics
    (docs/torchserve.md). Every ``add_*`` call a handler makes is a no-op."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("add_") or name.startswith("get_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class RequestProcessor:
    """One request's headers, and the status and headers its answer goes out with."""

    def __init__(self, request_header: dict[str, Any]) -> None:
        self._status_code = 200
        self._reason_phrase: str | None = None
        self._response_header: dict[str, str] = {}
        self._request_header = request_header

    def get_request_property(self, key: str) -> Any:
        return self._request_header.get(key)

    def report_status(self, code: int, reason_phrase: str | None = None) -> None:
        self._status_code = code
        self._reason_phrase = reason_phrase

    def get_response_status_code(self) -> int:
        return self._status_code

    def get_response_status_phrase(self) -> str | None:
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        self._response_header[key] = value

    def get_response_headers(self) -> dict[str, str]:
        return self._response_header

    def get_response_header(self, key: str) -> str | None:
        return self._response_header.get(key)

    def get_request_properties(self) -> dict[str, Any]:
        return self._request_header


class Context:
    """The model's manifest, system properties and model-config.yaml, and, during ``handle``,
    each request of the batch by index."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any],
        batch_size: int,
        gpu: int | None,
        mms_version: str,
        limit_max_image_pixels: bool = True,
        metrics: Any = None,
        model_yaml_config: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest = manifest
        self._system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": "MMS",
            "server_version": mms_version,
            "limit_max_image_pixels": limit_max_image_pixels,
        }
        self.request_ids: dict[int, str] | None = None
        self._request_processor: list[RequestProcessor] = []
        self.metrics = metrics if metrics is not None else Metrics()
        self.model_yaml_config = model_yaml_config or {}
        self.stopping_criteria = None

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    @property
    def request_processor(self) -> list[RequestProcessor]:
        return self._request_processor

    @request_processor.setter
    def request_processor(self, request_processor: list[RequestProcessor]) -> None:
        self._request_processor = request_processor

    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx) if self.request_ids else None

    def get_request_header(self, idx: int, key: str) -> Any:
        return self._request_processor[idx].get_request_property(key)

    def get_all_request_header(self, idx: int) -> dict[str, Any]:
        return self._request_processor[idx].get_request_properties()

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.set_response_header(idx, "content-type", value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self.get_response_headers(idx).get("content-type")

    def get_response_status(self, idx: int) -> tuple[int, str | None]:
        processor = self._request_processor[idx]
        return processor.get_response_status_code(), processor.get_response_status_phrase()

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        if self._request_processor:
            self._request_processor[idx].report_status(code, phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for processor in self._request_processor:
            processor.report_status(code, phrase)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self._request_processor[idx].get_response_headers()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self._request_processor[idx].add_response_property(key, value)
