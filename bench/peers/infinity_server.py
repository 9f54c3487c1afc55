"""Peer: infinity (infinity-emb) serving minilm with its torch or its ONNX Runtime engine.

Run with the infinity venv's python (``bench/peers/envs.py``). infinity loads a model from a
Hugging Face-style folder and must be started from inside it with ``--model-id .``, so this
script lays out a folder of its own (``--work-dir``) whose entries link to the package's model
files, adds an ONNX export (``model.onnx``, the layout optimum writes: inputs ``input_ids``,
``attention_mask``, ``token_type_ids``, output ``last_hidden_state``) for the ONNX engine, then
replaces itself (``exec``) with ``infinity_emb v2`` in that folder. Pooling is set to mean
(infinity pools the CLS token otherwise), on 127.0.0.1 only, telemetry off, hub offline; its
ONNX optimiser's cache lives in the work folder (``HF_HOME``), not the user's. It answers
OpenAI-style ``POST /embeddings``; ``GET /health`` turns 200 once the model is loaded and warm.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

EXPORT_TIMEOUT_S = 600
ENGINES = ("torch", "optimum")
ONNX_FILE = "model.onnx"
EXPORT_STAMP = "model.onnx.source"
"""Beside the export: which weights it came from, so new weights are exported again."""


def infinity_command(
    infinity: Path,
    *,
    engine: str,
    port: int,
    batch_size: int,
    served_name: str,
    bettertransformer: bool = True,
) -> list[str]:
    """The ``infinity_emb v2`` command line, run from inside the model folder."""
    return [
        str(infinity),
        "v2",
        *("--model-id", ".", "--served-model-name", served_name),
        *("--engine", engine, "--device", "cpu", "--pooling-method", "mean"),
        *("--batch-size", str(batch_size)),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--log-level", "warning"),
        "--bettertransformer" if bettertransformer else "--no-bettertransformer",
    ]


def weights_digest(model_dir: Path) -> str:
    """Name, size and modification time of the weights: cheap, and changes when they do."""
    weights = (model_dir / "model.safetensors").resolve()
    info = weights.stat()
    return hashlib.sha256(f"{weights}:{info.st_size}:{info.st_mtime_ns}".encode()).hexdigest()


def prepare_folder(model_dir: Path, work_dir: Path) -> None:
    """``work_dir`` with a link to every entry of ``model_dir`` (a link already there stays)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for entry in sorted(model_dir.iterdir()):
        link = work_dir / entry.name
        if link.is_symlink() and link.resolve() == entry.resolve():
            continue
        if link.is_symlink() or link.is_file():
            link.unlink()
        link.symlink_to(entry.resolve())


def ensure_onnx(model_dir: Path, work_dir: Path) -> None:
    """Export ``model.onnx`` into ``work_dir`` unless an export of the same weights is there;
    a new export also drops infinity's optimised copy of the old one."""
    digest = weights_digest(model_dir)
    stamp = work_dir / EXPORT_STAMP
    if (work_dir / ONNX_FILE).is_file() and stamp.is_file() and stamp.read_text() == digest:
        return
    staging = work_dir / ".export"
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run(
        [sys.executable, __file__, "--export-onnx", str(model_dir), str(staging)],
        check=True,
        timeout=EXPORT_TIMEOUT_S,
    )
    os.replace(staging / ONNX_FILE, work_dir / ONNX_FILE)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(work_dir / ".hf-home", ignore_errors=True)
    stamp.write_text(digest)


def export_onnx(model_dir: Path, output: Path) -> None:
    """BERT's ``last_hidden_state`` as ONNX in optimum's layout, checked against torch.

    torch's TorchScript-based exporter with batch and sequence dynamic: optimum 1.27's own
    exporter imports a torch symbol that torch 2.13 no longer has. Eager attention keeps the
    graph to plain ops; the export is refused when ONNX Runtime and torch disagree on a probe
    batch with padding.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    import numpy as np
    import onnxruntime
    import torch
    from transformers import BertModel

    class LastHidden(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, *tokens: torch.Tensor) -> torch.Tensor:
            names = ("input_ids", "attention_mask", "token_type_ids")
            hidden: torch.Tensor = self.bert(**dict(zip(names, tokens, strict=True)))[0]
            return hidden

    bert = BertModel.from_pretrained(
        str(model_dir), local_files_only=True, attn_implementation="eager"
    )
    module = LastHidden(bert).eval()
    ids = torch.tensor([[101, 7592, 2088, 2003, 102], [101, 7592, 102, 0, 0]])
    probe = (ids, (ids > 0).to(torch.int64), torch.zeros_like(ids))
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {name: {0: "batch", 1: "sequence"} for name in [*names, "last_hidden_state"]}
    output.mkdir(parents=True, exist_ok=True)
    target = output / ONNX_FILE
    torch.onnx.export(
        module,
        probe,
        str(target),
        input_names=names,
        output_names=["last_hidden_state"],
        dynamic_axes=axes,
        opset_version=17,
        dynamo=False,
    )
    module.eval()  # the exporter leaves the module in training mode
    with torch.inference_mode():
        expected = module(*probe).numpy()
    session = onnxruntime.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: t.numpy() for n, t in zip(names, probe, strict=True)})[0]
    error = float(np.abs(got - expected).max())
    if error > 1e-3:
        raise RuntimeError(f"ONNX export disagrees with torch: max abs diff {error:.3g}")


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["--export-onnx"]:
        export_onnx(Path(arguments[1]), Path(arguments[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("minilm",), default="minilm")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--engine", choices=ENGINES, default="torch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--no-bettertransformer",
        action="store_true",
        help="torch engine: plain transformers forward instead of infinity's default fast path",
    )
    args = parser.parse_args(arguments)
    work_dir = args.work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    # Two servers started at once on one folder would export into the same staging folder.
    with (work_dir / ".prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prepare_folder(args.model_dir, work_dir)
        if args.engine == "optimum":
            ensure_onnx(args.model_dir, work_dir)
    infinity = Path(sys.executable).parent / "infinity_emb"
    command = infinity_command(
        infinity,
        engine=args.engine,
        port=args.port,
        batch_size=args.batch_size,
        served_name=args.model,
        bettertransformer=not args.no_bettertransformer,
    )
    os.environ.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(work_dir / ".hf-home"),
            "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        }
    )
    os.chdir(work_dir)
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
