"""TorchServe's default ``image_segmenter`` handler: ImageNet resize, crop and normalisation, then
per pixel the most probable class and its softmax probability, from the model's ``out`` map."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...vision import transforms
from ..handler_utils.timer import timed
from .vision_handler import VisionHandler


class ImageSegmenter(VisionHandler):
    """For a model answering ``{"out": [N, K, H, W]}`` (torchvision's segmentation models), each
    image's answer is an ``H x W`` grid of ``[class index (a float), probability]``: the top
    class alone, as every class's scores would make answers far too large."""

    image_processing = transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )

    @timed
    def postprocess(self, data: Any) -> Any:
        scores = F.softmax(data["out"], dim=1)
        best = torch.max(scores, dim=1)
        grid = torch.stack([best.indices.to(best.values.dtype), best.values], dim=3)
        return grid.tolist()
