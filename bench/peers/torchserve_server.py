"""Peer: TorchServe with its request batching, started the way its documentation does it.

Run with the TorchServe venv's python (``bench/peers/envs.py``). In a fresh temporary folder it
archives ``torchserve_handler.py`` with ``torch-model-archiver`` (the weights stay where they are:
the handler reads them by path), writes ``config.properties`` (inference, management and metrics
on 127.0.0.1, free ports for the last two and for the workers' sockets, batching and worker count
for the model) and runs ``torchserve --foreground`` in that folder, so its logs land there too.
Token authorisation is off (``--disable-token-auth``) and no config snapshot is written
(``--ncs``). The folder is removed when the server stops.

The handler parses the same KServe V2 JSON bodies nograd reads; TorchServe routes them at
``/predictions/<model>`` (``/v2/models/<model>/infer`` when its frontend has the KServe route).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType

HERE = Path(__file__).resolve().parent
DIGITS_DIR = HERE.parents[1] / "models" / "digits"
ARCHIVE_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_properties(
    *,
    model: str,
    port: int,
    management_port: int,
    metrics_port: int,
    worker_port: int,
    model_store: Path,
    workers: int,
    batch_size: int,
    max_batch_delay_ms: int,
    grpc_ports: tuple[int, int] | None = None,
) -> str:
    """TorchServe's settings for one model: every listener on 127.0.0.1, the model's batching and
    worker count fixed (min = max), its system-metrics sampler off (a process every minute)."""
    models = {
        model: {
            "1.0": {
                "defaultVersion": True,
                "marName": f"{model}.mar",
                "minWorkers": workers,
                "maxWorkers": workers,
                "batchSize": batch_size,
                "maxBatchDelay": max_batch_delay_ms,
                "responseTimeout": 120,
            }
        }
    }
    lines = [
        f"inference_address=http://127.0.0.1:{port}",
        f"management_address=http://127.0.0.1:{management_port}",
        f"metrics_address=http://127.0.0.1:{metrics_port}",
        f"initial_worker_port={worker_port}",
        f"model_store={model_store}",
        f"load_models={model}.mar",
        f"models={json.dumps(models)}",
        f"default_workers_per_model={workers}",
        "job_queue_size=1000",
        "disable_token_authorization=true",
        "install_py_dep_per_model=false",
        "disable_system_metrics=true",
    ]
    if grpc_ports is not None:
        # Its gRPC listeners default to 7070/7071: a second instance could not bind them.
        lines += [f"grpc_inference_port={grpc_ports[0]}", f"grpc_management_port={grpc_ports[1]}"]
    return "\n".join(lines) + "\n"


def _archive(model: str, model_dir: Path, folder: Path) -> Path:
    """``<folder>/store/<model>.mar`` holding the handler, ``peer_models.py`` and which weights
    (their folder by absolute path: the archive is unpacked somewhere else)."""
    store = folder / "store"
    store.mkdir()
    settings = folder / "peer_model.json"
    settings.write_text(json.dumps({"model": model, "model_dir": str(model_dir.resolve())}))
    shutil.copy(HERE / "peer_models.py", folder / "peer_models.py")
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    subprocess.run(
        [
            str(archiver),
            *("--model-name", model, "--version", "1.0"),
            *("--handler", str(HERE / "torchserve_handler.py")),
            *("--extra-files", f"{folder / 'peer_models.py'},{settings}"),
            *("--export-path", str(store)),
        ],
        check=True,
        timeout=ARCHIVE_TIMEOUT_S,
    )
    return store


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("digits", "minilm"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--model-dir", type=Path, help="minilm: the HF-style folder; digits: models/digits"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-delay-ms", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if args.model == "minilm" and args.model_dir is None:
        parser.error("--model-dir is required for minilm")
    if shutil.which("java") is None:
        print("torchserve needs java on PATH (OpenJDK 17)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_signal)
    folder = Path(tempfile.mkdtemp(prefix="nograd-torchserve-"))
    process: subprocess.Popen[bytes] | None = None
    try:
        store = _archive(args.model, args.model_dir or DIGITS_DIR, folder)
        config = folder / "config.properties"
        config.write_text(
            config_properties(
                model=args.model,
                port=args.port,
                management_port=_free_port(),
                metrics_port=_free_port(),
                worker_port=_free_port(),
                model_store=store,
                workers=args.workers,
                batch_size=args.batch_size,
                max_batch_delay_ms=args.max_batch_delay_ms,
                grpc_ports=(_free_port(), _free_port()),
            )
        )
        bin_dir = Path(sys.executable).parent
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "LOG_LOCATION": str(folder / "logs"),
            "METRICS_LOCATION": str(folder / "logs"),
            "HF_HUB_OFFLINE": "1",
            # TorchServe keeps one pid file in the temp folder and refuses to start beside
            # another instance using it: its own temp folder lets digits and minilm run at once.
            "TMPDIR": str(folder),
        }
        command = [
            str(bin_dir / "torchserve"),
            *("--start", "--foreground", "--ncs", "--disable-token-auth"),
            *("--ts-config", str(config), "--model-store", str(store)),
        ]
        process = subprocess.Popen(command, cwd=folder, env=env)
        return process.wait()
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
