"""TorchServe's ``VisionHandler``: each request's image (bytes, base64 text or a list of
numbers) through the handler's ``image_processing``, stacked into one batch."""

from __future__ import annotations

import base64
import io
from abc import ABC
from typing import Any

import torch
from PIL import Image

from ..handler_utils.timer import timed
from .base_handler import BaseHandler


class VisionHandler(BaseHandler, ABC):
    image_processing: Any = None

    def initialize(self, context: Any) -> None:
        super().initialize(context)
        self.initialized = True
        if not context.system_properties.get("limit_max_image_pixels"):
            Image.MAX_IMAGE_PIXELS = None

    @timed
    def preprocess(self, data: Any) -> Any:
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, str):
                image = base64.b64decode(image)
            if isinstance(image, bytearray | bytes):
                image = self.image_processing(Image.open(io.BytesIO(image)))
            else:
                image = torch.FloatTensor(image)
            images.append(image)
        return torch.stack(images).to(self.device)
