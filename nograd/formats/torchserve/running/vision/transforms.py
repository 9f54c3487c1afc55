"""``torchvision.transforms`` for PIL images, as torchvision computes them: ``Resize`` (shorter
edge, PIL bilinear), ``CenterCrop``, ``ToTensor`` (CxHxW floats in [0, 1]), ``Normalize`` and
``Compose``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    def __call__(self, image: Image.Image) -> torch.Tensor:
        array = np.array(image, copy=True)
        if array.ndim == 2:
            array = array[:, :, None]
        tensor = torch.from_numpy(array.transpose(2, 0, 1).copy()).contiguous()
        if tensor.dtype == torch.uint8:
            return tensor.to(torch.float32).div(255)
        return tensor.to(torch.float32)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> None:
        self.mean = list(mean)
        self.std = list(std)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub(mean).div(std)


class Resize:
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if isinstance(self.size, int):
            short, long = min(width, height), max(width, height)
            new_short, new_long = self.size, int(self.size * long / short)
            size = (new_short, new_long) if width <= height else (new_long, new_short)
        else:
            size = (int(self.size[1]), int(self.size[0]))
        return image.resize(size, Image.Resampling.BILINEAR)


class CenterCrop:
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        crop_height, crop_width = self.size
        # torchvision's int(round(...)): Python's round, half to even.
        top = round((height - crop_height) / 2.0)
        left = round((width - crop_width) / 2.0)
        return image.crop((left, top, left + crop_width, top + crop_height))
