"""Record what real TorchServe answers for the test archives (tests/fixtures/torchserve).

The archives of ``tests/torchserve_archives.py`` (TorchServe's MNIST example with its custom
handler, the default ``image_classifier`` handler, function handlers) are built with this
checkout's torch-model-archiver and seeded weights, served by TorchServe 0.12 with real
torchvision (the ``torchserve-vision`` peer venv, ``bench/peers/envs.py``), and sent the calls of
``tests/torchserve_exchanges.py``; the e2e tests send nograd the same calls and compare.

    python scripts/record_torchserve_answers.py            # builds the venv on first use
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
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peers.envs import ensure_env  # noqa: E402
from tests.torchserve_archives import build_store  # noqa: E402
from tests.torchserve_exchanges import ANSWERS, EXCHANGES, send  # noqa: E402

START_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(folder: Path, store: Path, ports: dict[str, int]) -> Path:
    """Every listener on 127.0.0.1 and free ports; every archive of the store loaded; no token
    authorisation (the management calls are compared without one)."""
    lines = [
        f"inference_address=http://127.0.0.1:{ports['inference']}",
        f"management_address=http://127.0.0.1:{ports['management']}",
        f"metrics_address=http://127.0.0.1:{ports['metrics']}",
        f"initial_worker_port={ports['worker']}",
        f"grpc_inference_port={ports['grpc_inference']}",
        f"grpc_management_port={ports['grpc_management']}",
        f"model_store={store}",
        "load_models=all",
        "default_workers_per_model=1",
        "disable_token_authorization=true",
        "install_py_dep_per_model=false",
        "disable_system_metrics=true",
    ]
    path = folder / "config.properties"
    path.write_text("\n".join(lines) + "\n", "utf-8")
    return path


def _wait_ready(client: httpx.Client, base: dict[str, str], models: list[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            described = [client.get(f"{base['management']}/models/{m}") for m in models]
            if all(
                r.status_code == 200 and any(w["status"] == "READY" for w in r.json()[0]["workers"])
                for r in described
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"TorchServe did not load {models} in {START_TIMEOUT_S:.0f} s")


def record(python: Path, out: Path) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="nograd-ts-answers-"))
    process: subprocess.Popen[bytes] | None = None
    try:
        archives = build_store(folder / "store", folder / "work")
        names = ("inference", "management", "metrics", "worker", "grpc_inference")
        ports = {name: _free_port() for name in (*names, "grpc_management")}
        config = _config(folder, folder / "store", ports)
        bin_dir = python.parent
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "LOG_LOCATION": str(folder / "logs"),
            "METRICS_LOCATION": str(folder / "logs"),
            "TMPDIR": str(folder),
        }
        command = [
            str(bin_dir / "torchserve"),
            *("--start", "--foreground", "--ncs", "--disable-token-auth"),
            *("--ts-config", str(config), "--model-store", str(folder / "store")),
        ]
        log = (folder / "torchserve.log").open("wb")
        process = subprocess.Popen(
            command,
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        base = {
            "inference": f"http://127.0.0.1:{ports['inference']}",
            "management": f"http://127.0.0.1:{ports['management']}",
        }
        with httpx.Client(timeout=120) as client:
            _wait_ready(client, base, sorted(archives))
            answers = {exchange.name: send(client, base, exchange) for exchange in EXCHANGES}
        packages = subprocess.run(
            [str(python), "-c", "import torch, torchvision, ts; "
             "print(ts.__version__, torch.__version__, torchvision.__version__)"],
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout.split()  # fmt: skip
        document = {
            "recorded_with": {
                "torchserve": packages[0],
                "torch": packages[1],
                "torchvision": packages[2],
                "command": "python scripts/record_torchserve_answers.py",
            },
            "answers": answers,
        }
        out.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n", "utf-8")
        return document
    except BaseException:
        if process is not None:
            print(
                (folder / "torchserve.log").read_text("utf-8", "replace")[-4000:], file=sys.stderr
            )
        raise
    finally:
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", type=Path, help="a TorchServe venv's python (default: built)")
    parser.add_argument("--out", type=Path, default=ANSWERS)
    args = parser.parse_args(argv)
    python = args.python
    if python is None:
        env = ensure_env("torchserve-vision")
        if not env.ok or env.python is None:
            print(env.reason, file=sys.stderr)
            return 2
        python = env.python
    document = record(python, args.out)
    print(f"{len(document['answers'])} answers from TorchServe written to {args.out}")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
