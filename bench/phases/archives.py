"""The same TorchServe archive served by nograd and by TorchServe: TorchServe's MNIST example
(``mnist.mar``, its custom handler, batching from its ``model-config.yaml``) built once with the
real ``torch-model-archiver``, one model store both servers read, their answers compared body for
body, then paired rounds of ``PUT /predictions/mnist`` with a PNG body at the same concurrency."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import workloads
from bench.common import AS_SHIPPED, RESULTS, Server, http_send, nograd_server
from bench.peers.envs import ensure_env
from bench.peers.torchserve_archives import DIGITS, build_mnist
from bench.peers.torchserve_store import torchserve_store_server
from bench.phases.peers import NOGRAD, PEER_READY_TIMEOUT_S, measure_rounds, start_peer
from bench.session import Bench

TORCHSERVE = "torchserve"
NOGRAD_ONE = "nograd-workers-1"
WORKLOAD = "mnist-png"
ENV = "torchserve-vision"
"""TorchServe 0.12 with real torchvision: its vision handlers (the MNIST one) import it."""
CHECK_THREADS = 8
"""Answer-check requests in flight at once: the archive's batchSize, so its 200 ms batch delay
is not paid once per request."""

Answer = tuple[int, bytes]


def same_answer(a: Answer, b: Answer) -> bool:
    """Same status and the same body: equal as JSON where both parse (TorchServe and nograd may
    lay JSON out differently), byte for byte otherwise."""
    if a[0] != b[0]:
        return False
    try:
        return bool(json.loads(a[1]) == json.loads(b[1]))
    except ValueError:
        return a[1] == b[1]


def compare_answers(ours: list[Answer], theirs: list[Answer]) -> dict[str, Any]:
    """How many answers agree, and the first disagreement (index, both answers) if any."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} answers against {len(theirs)}")
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if not same_answer(a, b)]
    first = None
    if differ:
        i = differ[0]
        first = {
            "index": i,
            NOGRAD: [ours[i][0], ours[i][1][:200].decode(errors="replace")],
            TORCHSERVE: [theirs[i][0], theirs[i][1][:200].decode(errors="replace")],
        }
    return {"requests": len(ours), "same": len(ours) - len(differ), "first_difference": first}


def archive_concurrencies(headline: int, batch_size: int) -> list[int]:
    """The plan's concurrency and the archive's batch size (a closed loop that just fills one
    batch), highest first."""
    return sorted({headline, batch_size}, reverse=True)


def phase_archives(bench: Bench) -> None:
    """Build ``mnist.mar``, serve it with nograd (as shipped, and as one process where ``auto``
    picks more) and TorchServe, check the answers agree, then measure them in paired rounds; a
    TorchServe that cannot be set up, started or does not agree
    is reported with the reason and measured no further."""
    record: dict[str, Any] = {"archive": "mnist.mar", "workload": WORKLOAD, "runs": []}
    bench.results["archives"] = record
    bench.step(f"archives: set up {ENV}")
    env = ensure_env(ENV)
    record["env"] = {"ok": env.ok, "reason": env.reason, "seconds": round(env.seconds, 1)}
    if not env.ok or env.python is None:
        record["refused"] = f"{ENV} cannot run: {env.reason}"
        bench.note(record["refused"])
        return
    folder = RESULTS / f"{bench.stamp}-archives"
    store = folder / "store"
    bench.step("archives: build mnist.mar")
    mar = build_mnist(store, folder / "work", python=env.python)
    # nograd warms an archive up (and plans its memory) with a sample request beside it.
    (store / "mnist.sample.png").write_bytes(DIGITS["0"])
    record["sha256"] = hashlib.sha256(mar.read_bytes()).hexdigest()
    record["batch_size"] = 8
    wl = workloads.make(WORKLOAD)
    bench.bodies[WORKLOAD] = wl.write_bodies(RESULTS / "bodies")
    meta = bench.results.get("meta", {})
    record["nograd_default_fronts"] = int(meta.get("default_fronts") or 0)
    record["nograd_workers"] = 1 if record["nograd_default_fronts"] else meta.get("auto_workers", 1)
    cpus = bench.plan.server_cpus
    with contextlib.ExitStack() as stack:
        bench.step("archives: start nograd")
        nograd = stack.enter_context(nograd_server(store, cpus, AS_SHIPPED))
        torchserve = torchserve_store_server(env.python, store, folder / TORCHSERVE, cpus)
        bench.step("archives: start TorchServe")
        reason = start_peer(bench, torchserve)
        if reason is not None:
            record["refused"] = reason
            return
        stack.callback(torchserve.stop)
        record["torchserve_version"] = _version(env.python)
        try:
            _until_answering(torchserve, wl)
        except TimeoutError as exc:
            record["refused"] = f"{torchserve.name}: {exc}: {torchserve.log_tail(10)}"[-600:]
            bench.note(record["refused"])
            return
        bench.step("archives: compare answers")
        check = compare_answers(answers_of(nograd, wl), answers_of(torchserve, wl))
        record["check"] = check
        if check["same"] != check["requests"]:
            record["refused"] = f"answers differ from nograd's: {check['first_difference']}"
            bench.note(record["refused"][:300])
            return
        systems = [(NOGRAD, nograd), (TORCHSERVE, torchserve)]
        if record["nograd_default_fronts"] or record["nograd_workers"] != 1:
            # The archive asks TorchServe for one worker: nograd as one process beside it.
            bench.step("archives: start nograd, one process")
            one = stack.enter_context(nograd_server(store, cpus, {"NOGRAD_WORKERS": "1"}))
            systems.insert(1, (NOGRAD_ONE, one))
        concurrencies = archive_concurrencies(bench.plan.concurrency, record["batch_size"])
        record["runs"] = measure_rounds(
            bench, {WORKLOAD: systems}, [s for _, s in systems], concurrencies, "archives"
        )


def _send(server: Server, wl: workloads.Workload, body: bytes) -> Answer:
    return http_send(
        server.url + wl.path, body, method=wl.method, content_type=wl.content_type, timeout=60.0
    )


def answers_of(server: Server, wl: workloads.Workload) -> list[Answer]:
    """``server``'s answer to every body of the workload, ``CHECK_THREADS`` at a time."""
    with ThreadPoolExecutor(CHECK_THREADS) as pool:
        return list(pool.map(lambda body: _send(server, wl, body), wl.bodies))


def _until_answering(server: Server, wl: workloads.Workload) -> None:
    """TorchServe's ``/ping`` is healthy while its worker may still be loading the model: wait
    until a prediction is answered."""
    deadline = time.monotonic() + PEER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if _send(server, wl, wl.bodies[0])[0] == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"no prediction answered in {PEER_READY_TIMEOUT_S:.0f} s")


def _version(python: Path) -> str:
    """TorchServe's and its torch's versions, as the venv reports them."""
    out = subprocess.run(
        [str(python), "-c", "import ts, torch; print(ts.__version__, 'torch', torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"
