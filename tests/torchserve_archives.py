"""TorchServe archives built the way TorchServe's users build them: the real
``torch-model-archiver`` over TorchServe's example sources (tests/fixtures/torchserve/), with
seeded weights where the original is a download. The MNIST archive and the archiver call are the
bench's (``bench.peers.torchserve_archives``), which serves the same ``mnist.mar``."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.peers.torchserve_archives import DIGITS, FIXTURES, MNIST, archive, build_mnist

CLASSIFIER = FIXTURES / "classifier"
KITTEN = (CLASSIFIER / "kitten_small.jpg").read_bytes()

__all__ = ["CLASSIFIER", "DIGITS", "FIXTURES", "KITTEN", "MNIST", "build_store"]


def scale_model(path: Path) -> Path:
    """A seeded TorchScript linear layer (4 -> 2) for the function handler."""
    torch.manual_seed(1)
    torch.jit.script(torch.nn.Linear(4, 2)).save(str(path))
    return path


def classifier_model(path: Path) -> Path:
    """A seeded TorchScript image classifier with ImageNet's 1,000 classes, small enough to
    build in a test: where TorchServe's squeezenet example has downloaded weights, the default
    ``image_classifier`` handler runs this one on the same images."""
    torch.manual_seed(2)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=8, stride=8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 1000),
    ).eval()
    torch.jit.trace(net, torch.zeros(1, 3, 224, 224)).save(str(path))
    return path


class TinySegmenter(torch.nn.Module):
    """A segmentation model as torchvision's are called: images in, ``{"out": [N, K, H, W]}``
    out (four classes on a grid of 8x8 patches, so answers stay small)."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 4, kernel_size=8, stride=8)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.patches(images)}


def segment_model(path: Path) -> Path:
    """A seeded TorchScript ``TinySegmenter``."""
    torch.manual_seed(2)
    torch.jit.script(TinySegmenter().eval()).save(str(path))
    return path


def scale_archive(store: Path, work: Path) -> Path:
    """``scale.mar`` (version 2.1): the function handler over ``scale_model``."""
    return archive(
        store,
        "scale",
        "--version", "2.1",
        "--serialized-file", str(scale_model(work / "scale.pt")),
        "--handler", str(FIXTURES / "function" / "scale_handler.py"),
    )  # fmt: skip


def build_store(store: Path, work: Path) -> dict[str, Path]:
    """``mnist.mar`` (custom handler, batchSize 8), ``classifier.mar`` (the default
    ``image_classifier`` handler on a TorchScript model, batchSize 4), ``scale.mar`` (function
    handler), ``lazy.mar`` (a function handler importing a file of its archive inside
    ``handle``), ``segment.mar`` (the default ``image_segmenter``, batchSize 4) and
    ``headers.mar`` (a function handler answering each input's type and headers) in
    ``store``."""
    store.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    mnist = build_mnist(store, work)
    classifier = archive(
        store,
        "classifier",
        "--version", "1.0",
        "--serialized-file", str(classifier_model(work / "classifier.pt")),
        "--handler", "image_classifier",
        "--extra-files", str(CLASSIFIER / "index_to_name.json"),
        "--config-file", str(CLASSIFIER / "model-config.yaml"),
    )  # fmt: skip
    scale = scale_archive(store, work)
    lazy = archive(
        store,
        "lazy",
        "--version", "1.0",
        "--handler", str(FIXTURES / "lazy" / "lazy_handler.py"),
        "--extra-files", str(FIXTURES / "lazy" / "lazy_helper.py"),
    )  # fmt: skip
    segment = archive(
        store,
        "segment",
        "--version", "1.0",
        "--serialized-file", str(segment_model(work / "segment.pt")),
        "--handler", "image_segmenter",
        "--config-file", str(FIXTURES / "segment" / "model-config.yaml"),
    )  # fmt: skip
    headers = archive(
        store,
        "headers",
        "--version", "1.0",
        "--handler", str(FIXTURES / "headers" / "headers_handler.py"),
    )  # fmt: skip
    return {
        "headers": headers,
        "mnist": mnist,
        "classifier": classifier,
        "scale": scale,
        "lazy": lazy,
        "segment": segment,
    }
