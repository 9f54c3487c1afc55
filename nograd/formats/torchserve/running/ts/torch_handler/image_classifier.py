"""TorchServe's default ``image_classifier`` handler: ImageNet resize, crop and normalisation,
then the top 5 classes by softmax probability, named by ``index_to_name.json``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...vision import transforms
from ..handler_utils.timer import timed
from ..utils.util import map_class_to_label
from .vision_handler import VisionHandler


class ImageClassifier(VisionHandler):
    topk = 5
    image_processing = transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )

    def set_max_result_classes(self, topk: int) -> None:
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    @timed
    def postprocess(self, data: Any) -> Any:
        ps = F.softmax(data, dim=1)
        probs, classes = torch.topk(ps, self.topk, dim=1)
        return map_class_to_label(probs.tolist(), self.mapping, classes.tolist())
