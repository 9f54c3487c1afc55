"""TorchServe's ``BaseHandler``: loads an eager model (model file + state dict) or a TorchScript
file, then ``handle`` = preprocess, inference, postprocess, as TorchServe's does.

Differences, on purpose: a state dict is read with ``weights_only=True`` (TorchServe unpickles it
whole), and the compile, IPEX, ONNX, AOT and profiler branches are not taken (docs/torchserve.md).
"""

from __future__ import annotations

import abc
import importlib
import logging
import os
from typing import Any

import torch

from ..handler_utils.timer import timed
from ..utils.util import list_classes_from_module, load_label_mapping

logger = logging.getLogger(__name__)


class BaseHandler(abc.ABC):  # noqa: B024 - TorchServe's base handler is abstract in name only
    """Base default handler for eager (state dict) and TorchScript models."""

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: dict[str, Any] | None = None
        self.device: torch.device | None = None
        self.initialized = False
        self.context: Any = None
        self.model_pt_path: str | None = None
        self.manifest: dict[str, Any] | None = None
        self.map_location: str | None = None
        self.explain = False
        self.target = 0
        self.profiler_args: dict[str, Any] = {}
        self.model_yaml_config: dict[str, Any] = {}

    def initialize(self, context: Any) -> None:
        if context is not None and hasattr(context, "model_yaml_config"):
            self.model_yaml_config = context.model_yaml_config
        properties = context.system_properties
        if torch.cuda.is_available() and properties.get("gpu_id") is not None:
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{properties.get('gpu_id')}")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")
        self.manifest = context.manifest
        model_dir = properties.get("model_dir")
        model = self.manifest["model"] if self.manifest else {}
        self.model_pt_path = None
        if "serializedFile" in model:
            self.model_pt_path = os.path.join(model_dir, model["serializedFile"])
        model_file = model.get("modelFile", "")
        if model_file:
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
            self.model.to(self.device)
            self.model.eval()
        elif self.model_pt_path is not None and self.model_pt_path.endswith(".pt"):
            self.model = self._load_torchscript_model(self.model_pt_path)
            self.model.eval()
        else:
            raise RuntimeError("No model weights could be loaded")
        self.mapping = load_label_mapping(os.path.join(model_dir, "index_to_name.json"))
        self.initialized = True

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        return torch.jit.load(  # type: ignore[no-untyped-call]
            model_pt_path, map_location=self.device
        )

    def _load_pickled_model(
        self, model_dir: str, model_file: str, model_pt_path: str | None
    ) -> Any:
        if not os.path.isfile(os.path.join(model_dir, model_file)):
            raise RuntimeError("Missing the model.py file")
        module = importlib.import_module(model_file.split(".")[0])
        definitions = list_classes_from_module(module)
        if len(definitions) != 1:
            raise ValueError(f"Expected only one class as model definition. {definitions}")
        model = definitions[0]()
        if model_pt_path:
            state_dict = torch.load(model_pt_path, map_location=self.device, weights_only=True)
            model.load_state_dict(state_dict)
        return model

    @timed
    def preprocess(self, data: Any) -> Any:
        return torch.as_tensor(data, device=self.device)

    @timed
    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return self.model(data.to(self.device), *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> Any:
        return data.tolist()

    def handle(self, data: Any, context: Any) -> Any:
        self.context = context
        if self._is_describe():
            return [self.describe_handle()]
        data_preprocess = self.preprocess(data)
        if self._is_explain():
            return self.explain_handle(data_preprocess, data)
        return self.postprocess(self.inference(data_preprocess))

    def explain_handle(self, data_preprocess: Any, raw_data: Any) -> Any:
        row = raw_data[0]
        target = row.get("target") or 0 if isinstance(row, dict) else 0
        inputs = (row.get("data") or row.get("body")) if isinstance(row, dict) else None
        return self.get_insights(data_preprocess, inputs, target)

    def get_insights(self, tensor_data: Any, raw: Any, target: Any) -> Any:
        raise NotImplementedError("explanations (captum) are not served by nograd")

    def _is_explain(self) -> bool:
        if self.context and self.context.get_request_header(0, "explain") == "True":
            self.explain = True
            return True
        return False

    def _is_describe(self) -> bool:
        return bool(self.context and self.context.get_request_header(0, "describe") == "True")

    def describe_handle(self) -> Any:
        return None

    def get_device(self) -> torch.device | None:
        return self.device
