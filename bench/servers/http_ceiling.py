"""Baseline (d): the HTTP ceiling of this stack (FastAPI + uvicorn) for digits.

It reads the same V2 body nograd reads, decodes it with orjson into a float32 array of the
declared shape, and answers with a response of the same shape and size (logits, probabilities,
label for each row) without running any model. The fastest parse and encode this stack offers,
so no serving system on it can beat this number; nograd's digits target is a fraction of it.

The issue's ceiling is one process, which uses one core however many the machine has.
``--processes N`` runs N of them on the same port, each on a listening socket of its own bound
with ``SO_REUSEPORT`` before any starts (the kernel spreads connections by a hash of their
addresses: five wrk runs of 32 connections split 16/16, 17/15, 18/14, 19/13 and 20/12 between two
processes). Each process stays saturated at such splits, so the throughput is the stack's own
limit on N cores; the busier process sets the tail. Context for a server with several workers.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v2/models/digits/infer")
    async def infer(request: Request) -> Response:
        document = orjson.loads(await request.body())
        tensor = document["inputs"][0]
        images = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        rows = int(images.shape[0])
        scores = np.full(rows * 10, 0.1, dtype=np.float32)
        labels = np.zeros(rows, dtype=np.int64)
        answer = {
            "model_name": "digits",
            "model_version": "1",
            "outputs": [
                {"name": "logits", "datatype": "FP32", "shape": [rows, 10], "data": scores},
                {"name": "probabilities", "datatype": "FP32", "shape": [rows, 10], "data": scores},
                {"name": "label", "datatype": "INT64", "shape": [rows, 1], "data": labels},
            ],
        }
        body = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(content=body, media_type="application/json")

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    return app


def listening_socket(port: int) -> socket.socket:
    """One of several sockets on the same port; listening at once, so connections the kernel
    hands it before its process serves wait in its backlog instead of failing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


def serve_processes(port: int, processes: int) -> int:
    """Start ``processes`` servers, one socket each; return when the first of them exits (the
    bench stops the whole process group)."""
    # SIGTERM to this process alone still stops the servers (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sockets = [listening_socket(port) for _ in range(processes)]
    children = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.servers.http_ceiling"),
                *("--port", str(port), "--fd", str(sock.fileno())),
            ],
            pass_fds=[sock.fileno()],
        )
        for sock in sockets
    ]
    for sock in sockets:
        sock.close()
    try:
        while all(child.poll() is None for child in children):
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            child.wait()
    return next((c.returncode for c in children if c.returncode), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--fd", type=int, help="serve on this inherited listening socket")
    args = parser.parse_args()
    if args.processes > 1:
        sys.exit(serve_processes(args.port, args.processes))
    config = uvicorn.Config(
        create_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )
    sockets = None if args.fd is None else [socket.socket(fileno=args.fd)]
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    main()
