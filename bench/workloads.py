"""The three workloads, as deterministic request bodies every system receives byte for byte.

(1) digits: one FP32 [1, 1, 8, 8] sample per request (overhead-bound);
(2) minilm-1: one sentence of 6–30 words per request (compute-bound);
(3) minilm-8: eight such sentences per request.

Every system is driven through the same route and body shape: the Open Inference Protocol (KServe
V2) JSON request at ``/v2/models/<model>/infer``; the baselines expose the same route and answer
with the same JSON shape.

Not in the default run: ``mnist-png``, one 28×28 PNG per request ``PUT`` to TorchServe's
``/predictions/mnist``, for TorchServe's MNIST archive served by nograd and by TorchServe
(``bench.phases.archives``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import orjson

SEED: Final = 20261121
BODIES_PER_WORKLOAD: Final = 512

# A small built-in vocabulary: ordinary English words, so the tokenizer splits them like real text.
_WORD_TEXT: Final = (
    "the a of and to in is was for on that with as by at from it this be are an or which "
    "model server batch request latency memory tensor device throughput queue token sentence "
    "vector search index query answer document page user system data network cloud cluster "
    "fast slow small large early late new old first last good better best simple quick "
    "river mountain city garden window kitchen morning evening winter summer coffee music "
    "teacher student doctor engineer farmer painter writer runner player driver sailor "
    "walks reads writes builds carries finds opens closes sends measures answers explains "
    "blue green bright quiet heavy light warm cold sharp gentle careful patient "
    "because although while after before during without between under over around through"
)
WORDS: Final = tuple(_WORD_TEXT.split())

MIN_WORDS: Final = 6
MAX_WORDS: Final = 30


def sentences(count: int, seed: int = SEED) -> list[str]:
    """``count`` sentences of 6–30 words from :data:`WORDS`, the same for a given seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def digits_images(count: int, seed: int = SEED) -> np.ndarray:
    """``count`` 8×8 images with sklearn digits' raw 0..16 intensities, [count, 1, 8, 8] FP32."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 17, size=(count, 1, 8, 8)).astype(np.float32)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    samples_per_request: int
    bodies: tuple[bytes, ...]
    description: str
    method: str = "POST"
    content_type: str = "application/json"
    route: str | None = None
    """The request path, where it is not V2's ``/v2/models/<model>/infer``."""

    @property
    def path(self) -> str:
        return self.route or f"/v2/models/{self.model}/infer"

    @property
    def binary(self) -> bool:
        """Raw bodies (not JSON), which may hold newlines: written hex-encoded for wrk."""
        return self.content_type != "application/json"

    def write_bodies(self, directory: Path) -> Path:
        """One body per line (JSON has no raw newlines; a binary body hex-encoded) for the wrk
        Lua script."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.binary:
            path = directory / f"bodies-{self.name}.hex"
            path.write_bytes(b"\n".join(body.hex().encode() for body in self.bodies) + b"\n")
            return path
        path = directory / f"bodies-{self.name}.txt"
        path.write_bytes(b"\n".join(self.bodies) + b"\n")
        return path


def digits_body(image: np.ndarray) -> bytes:
    return orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 1, 8, 8],
                    "datatype": "FP32",
                    "data": image.reshape(-1).tolist(),
                }
            ]
        }
    )


def text_body(texts: list[str]) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
    )


def mnist_pngs(count: int, seed: int = SEED) -> tuple[bytes, ...]:
    """``count`` 28×28 grayscale PNGs: TorchServe's three MNIST test digits, then seeded strokes
    on black (the handler sees real PNG decoding, whatever the pixels)."""
    import io

    from PIL import Image

    from bench.peers.torchserve_archives import DIGITS

    out = list(DIGITS.values())[:count]
    rng = np.random.default_rng(seed)
    while len(out) < count:
        pixels = np.zeros((28, 28), dtype=np.uint8)
        for _ in range(3):
            row, col = rng.integers(4, 24, size=2)
            pixels[row - 3 : row + 3, col - 1 : col + 2] = rng.integers(128, 256)
        buffer = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return tuple(out)


MNIST_PNG_BODIES: Final = 64


def make(name: str, count: int = BODIES_PER_WORKLOAD) -> Workload:
    if name == "digits":
        bodies = tuple(digits_body(image) for image in digits_images(count))
        return Workload(name, "digits", 1, bodies, "digits, 1 sample [1,1,8,8] FP32 per request")
    if name == "minilm-1":
        bodies = tuple(text_body([text]) for text in sentences(count))
        return Workload(name, "minilm", 1, bodies, "minilm, 1 sentence (6–30 words) per request")
    if name == "minilm-8":
        texts = sentences(count * 8, seed=SEED + 8)
        bodies = tuple(text_body(texts[i * 8 : i * 8 + 8]) for i in range(count))
        return Workload(name, "minilm", 8, bodies, "minilm, 8 sentences per request")
    if name == "mnist-png":
        return Workload(
            name,
            "mnist",
            1,
            mnist_pngs(min(count, MNIST_PNG_BODIES)),
            "TorchServe's MNIST archive, one 28x28 PNG per request (PUT /predictions/mnist)",
            method="PUT",
            content_type="application/octet-stream",
            route="/predictions/mnist",
        )
    raise ValueError(f"unknown workload {name!r}")


ALL: Final = ("digits", "minilm-1", "minilm-8")
