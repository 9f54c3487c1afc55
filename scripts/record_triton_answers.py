"""Record what Triton Inference Server answers for the test repository (tests/fixtures/triton).

The Python-backend models and ensembles of ``tests/triton_models.py`` are served by Triton 2.51,
the build PyTriton ships (the ``pytriton`` peer venv, ``bench/peers/envs.py``; it carries the
Python backend and no other), and sent the calls of ``tests/triton_exchanges.py`` over HTTP and
gRPC; the e2e tests send nograd the same calls and compare.

    python scripts/record_triton_answers.py            # builds the venv on first use
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import tritonclient.grpc as triton_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.serving import free_port  # noqa: E402
from tests.peer_answers import (  # noqa: E402
    print_log_tail,
    run_recorder,
    start_group,
    stop_group,
    write_answers,
)
from tests.triton_exchanges import ANSWERS, COMPARED, EXCHANGES, send_grpc, send_http  # noqa: E402
from tests.triton_models import triton_repository  # noqa: E402

START_TIMEOUT_S = 180.0


def _server_folder(python: Path, folder: Path) -> tuple[Path, Path]:
    """A copy of PyTriton's tritonserver with the Python backend stub of this interpreter, and
    the folder of the libraries it links."""
    where = "import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent)"
    found = subprocess.run(
        [str(python), "-c", where], capture_output=True, text=True, check=True, timeout=120
    )
    packages = Path(found.stdout.strip())
    server = folder / "tritonserver"
    shutil.copytree(packages / "tritonserver", server)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    shutil.copy(stub, server / "backends" / "python" / "triton_python_backend_stub")
    return server, packages.parent / "nvidia_pytriton.libs"


def _version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('nvidia-pytriton'))"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.strip()  # fmt: skip


def record(python: Path, out: Path) -> int:
    """Serve the models with Triton, send every call, write the answers; their count."""
    folder = Path(tempfile.mkdtemp(prefix="nograd-triton-answers-"))
    process: subprocess.Popen[bytes] | None = None
    log_path = folder / "tritonserver.log"
    try:
        repo = triton_repository(folder)
        server, libs = _server_folder(python, folder)
        http_port, grpc_port = free_port(), free_port()
        command = [
            str(server / "bin" / "tritonserver"),
            f"--model-repository={repo}",
            f"--backend-directory={server / 'backends'}",
            "--model-control-mode=explicit",
            *(f"--load-model={name}" for name in COMPARED),
            f"--http-port={http_port}",
            f"--grpc-port={grpc_port}",
            "--allow-metrics=false",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
        ]
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": f"{libs}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}",
            "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        process = start_group(command, folder, env, log_path)
        url = f"http://127.0.0.1:{http_port}"
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    if client.get(f"{url}/v2/health/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise TimeoutError("Triton did not become ready")
                time.sleep(0.5)
            grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            answers = {
                exchange.name: send_http(client, url, exchange)
                if exchange.api == "http"
                else send_grpc(grpc, exchange)
                for exchange in EXCHANGES
            }
            grpc.close()
        recorded_with = {
            "tritonserver": "2.51 (nvidia-pytriton " + _version(python) + ")",
            "command": "python scripts/record_triton_answers.py",
        }
        write_answers(out, recorded_with, _kept_where_equal(out, answers))
        return len(answers)
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        stop_group(process)
        shutil.rmtree(folder, ignore_errors=True)


def _kept_where_equal(out: Path, answers: dict[str, Any]) -> dict[str, Any]:
    """The answers, each equal to the one recorded before kept as it was written (Triton lists
    some maps in no fixed order), so a re-recording's diff shows only what changed."""
    if not out.exists():
        return answers
    before = json.loads(out.read_text("utf-8")).get("answers", {})
    kept = {name: before.get(name) for name in answers}
    return {
        name: kept[name] if kept[name] == answer else answer for name, answer in answers.items()
    }


def main(argv: list[str] | None = None) -> int:
    return run_recorder(__doc__ or "", "pytriton", record, ANSWERS, argv)


if __name__ == "__main__":
    sys.exit(main())
