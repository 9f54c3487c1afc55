"""Record what real TorchServe answers for the test archives (tests/fixtures/torchserve).

The archives of ``tests/torchserve_archives.py`` (TorchServe's MNIST example with its custom
handler, the default ``image_classifier`` handler, function handlers) are built with this
checkout's torch-model-archiver and seeded weights, served by TorchServe 0.12 with real
torchvision (the ``torchserve-vision`` peer venv, ``bench/peers/envs.py``), and sent the calls of
``tests/torchserve_exchanges.py``; the e2e tests send nograd the same calls and compare.

    python scripts/record_torchserve_answers.py            # builds the venv on first use
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import free_port  # noqa: E402
from bench.peers.torchserve_store import (  # noqa: E402
    StorePorts,
    store_command,
    store_config,
    store_env,
)
from tests.peer_answers import (  # noqa: E402
    print_log_tail,
    run_recorder,
    start_group,
    stop_group,
    write_answers,
)
from tests.torchserve_archives import build_store  # noqa: E402
from tests.torchserve_exchanges import ANSWERS, EXCHANGES, send  # noqa: E402

START_TIMEOUT_S = 240.0


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


def record(python: Path, out: Path) -> int:
    """Serve the archives with TorchServe, send every call, write the answers; their count."""
    folder = Path(tempfile.mkdtemp(prefix="nograd-ts-answers-"))
    log = folder / "torchserve.log"
    process: subprocess.Popen[bytes] | None = None
    try:
        archives = build_store(folder / "store", folder / "work")
        ports = StorePorts(inference=free_port())
        config = folder / "config.properties"
        config.write_text(store_config(folder / "store", ports), "utf-8")
        env = {**os.environ, **store_env(python, folder)}
        command = store_command(python, config, folder / "store")
        process = start_group(command, folder, env, log)
        base = {
            "inference": f"http://127.0.0.1:{ports.inference}",
            "management": f"http://127.0.0.1:{ports.management}",
        }
        with httpx.Client(timeout=120) as client:
            _wait_ready(client, base, sorted(archives))
            answers = {exchange.name: send(client, base, exchange) for exchange in EXCHANGES}
        packages = subprocess.run(
            [str(python), "-c", "import torch, torchvision, ts; "
             "print(ts.__version__, torch.__version__, torchvision.__version__)"],
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout.split()  # fmt: skip
        recorded_with = {
            "torchserve": packages[0],
            "torch": packages[1],
            "torchvision": packages[2],
            "command": "python scripts/record_torchserve_answers.py",
        }
        write_answers(out, recorded_with, answers)
        return len(answers)
    except BaseException:
        print_log_tail(log)
        raise
    finally:
        stop_group(process)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    return run_recorder(__doc__ or "", "torchserve-vision", record, ANSWERS, argv)


if __name__ == "__main__":
    sys.exit(main())
