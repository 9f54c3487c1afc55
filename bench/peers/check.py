"""Each peer's answers checked against nograd's reference before its numbers may count.

The reference comes from the main venv through ``bench/models.py``: the same model code, weights,
tokenizer and pooling nograd serves (its tests hold nograd's answers to that code at cosine 1.0).
A peer is sent the workload's first bodies, several at a time so its batcher pads and mixes
them as under load, and must answer every one with 200 and:

- minilm: cosine >= ``COSINE_MIN`` between each returned embedding and the reference embedding of
  the same sentence (cosine, not equality: ONNX Runtime and fused kernels reorder float sums);
- digits: logits and probabilities within ``DIGITS_MAX_ABS_DIFF`` of the reference, and the same
  argmax for every sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from bench.common import http_post
from bench.peers.protocol import (
    MODEL_OF_WORKLOAD,
    BodyFormat,
    answer_embeddings,
    answer_outputs,
    convert_body,
    request_images,
    request_texts,
    route,
)
from bench.workloads import make

COSINE_MIN: Final = 0.999
DIGITS_MAX_ABS_DIFF: Final = 1e-4
REQUESTS_CHECKED: Final = {"digits": 32, "minilm-1": 16, "minilm-8": 4}
PARALLEL_REQUESTS: Final = 8

Post = Callable[[str, bytes], tuple[int, bytes]]


@dataclass(frozen=True)
class CheckResult:
    """One peer system's verdict on one workload."""

    system: str
    workload: str
    passed: bool
    requests: int
    min_cosine: float | None = None
    max_abs_diff: float | None = None
    argmax_equal: bool | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def row_cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``got`` with the same row of ``expected`` (shapes must match)."""
    if got.shape != expected.shape:
        raise ValueError(f"shape {list(got.shape)} where {list(expected.shape)} was expected")
    a = np.asarray(got, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosines: np.ndarray = np.einsum("ij,ij->i", a, b) / np.maximum(norms, 1e-30)
    return cosines


def judge_embeddings(
    system: str, workload: str, pairs: Sequence[tuple[np.ndarray, np.ndarray]]
) -> CheckResult:
    """Pass when every row of every answer has cosine >= ``COSINE_MIN`` with its reference."""
    cosines = np.concatenate([row_cosines(got, want) for got, want in pairs])
    worst = float(cosines.min())
    passed = bool(worst >= COSINE_MIN)
    detail = "" if passed else f"min cosine {worst:.6f} < {COSINE_MIN}"
    return CheckResult(system, workload, passed, len(pairs), min_cosine=worst, detail=detail)


def judge_digits(
    system: str,
    workload: str,
    pairs: Sequence[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
) -> CheckResult:
    """Pass when logits and probabilities are within ``DIGITS_MAX_ABS_DIFF`` and every
    sample's argmax (and label, when returned) is the reference's."""
    worst = 0.0
    same_argmax = True
    for got, want in pairs:
        for name in ("logits", "probabilities"):
            if name not in got:
                return CheckResult(system, workload, False, len(pairs), detail=f"no {name}")
            diff = np.abs(got[name].reshape(want[name].shape) - want[name])
            worst = max(worst, float(diff.max()))
        winners = want["logits"].argmax(axis=1)
        same_argmax &= bool(np.array_equal(got["logits"].reshape(-1, 10).argmax(axis=1), winners))
        if "label" in got:
            same_argmax &= bool(np.array_equal(got["label"].reshape(-1), winners))
    passed = worst <= DIGITS_MAX_ABS_DIFF and same_argmax
    detail = "" if passed else f"max abs diff {worst:.3g}, argmax equal {same_argmax}"
    return CheckResult(
        system,
        workload,
        passed,
        len(pairs),
        max_abs_diff=worst,
        argmax_equal=same_argmax,
        detail=detail,
    )


class Reference:
    """nograd's answers from ``bench/models.py``, models loaded on first use only."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}

    def _model(self, name: str) -> Any:
        if name not in self._models:
            from bench.models import load

            self._models[name] = load(name)
        return self._models[name]

    def embeddings(self, texts: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            embedding: np.ndarray = self._model("minilm").embed(texts)["embedding"].numpy()
        return embedding

    def digits(self, images: np.ndarray) -> dict[str, np.ndarray]:
        import torch

        with torch.inference_mode():
            outputs = self._model("digits").forward(torch.from_numpy(images))
        return {name: outputs[name].numpy() for name in ("logits", "probabilities")}


def check_workload(
    base_url: str,
    system: str,
    workload: str,
    reference: Reference,
    *,
    post: Post = http_post,
    count: int | None = None,
) -> CheckResult:
    """Send the workload's first bodies to the running peer and judge its answers."""
    try:
        peer_route = route(system, workload)
    except ValueError as exc:
        return CheckResult(system, workload, False, 0, detail=str(exc))
    bodies = make(workload, count or REQUESTS_CHECKED[workload]).bodies
    sent = [convert_body(b, peer_route.body_format, MODEL_OF_WORKLOAD[workload]) for b in bodies]
    url = base_url + peer_route.path
    with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
        answers = list(pool.map(lambda body: _post_safely(post, url, body), sent))
    for status, answer in answers:
        if status != 200:
            detail = f"HTTP {status}: {answer[:200].decode(errors='replace')}"
            return CheckResult(system, workload, False, len(bodies), detail=detail)
    try:
        return _judge(system, workload, peer_route.body_format, bodies, answers, reference)
    except (ValueError, KeyError, TypeError) as exc:
        detail = f"unreadable answer: {type(exc).__name__}: {exc}"[:300]
        return CheckResult(system, workload, False, len(bodies), detail=detail)


def _post_safely(post: Post, url: str, body: bytes) -> tuple[int, bytes]:
    try:
        return post(url, body)
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}".encode()


def _judge(
    system: str,
    workload: str,
    body_format: BodyFormat,
    bodies: Sequence[bytes],
    answers: Sequence[tuple[int, bytes]],
    reference: Reference,
) -> CheckResult:
    if MODEL_OF_WORKLOAD[workload] == "minilm":
        pairs = [
            (answer_embeddings(answer, body_format), reference.embeddings(request_texts(body)))
            for body, (_, answer) in zip(bodies, answers, strict=True)
        ]
        return judge_embeddings(system, workload, pairs)
    digit_pairs = [
        (answer_outputs(answer), reference.digits(request_images(body)))
        for body, (_, answer) in zip(bodies, answers, strict=True)
    ]
    return judge_digits(system, workload, digit_pairs)
