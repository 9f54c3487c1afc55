"""Baseline (d): the HTTP ceiling of this stack (FastAPI + uvicorn, one worker) for digits.

It reads the same V2 body nograd reads, decodes it with orjson into a float32 array of the
declared shape, and answers with a response of the same shape and size (logits, probabilities,
label for each row) without running any model. The fastest parse and encode this stack offers,
so no serving system on it can beat this number; nograd's digits target is a fraction of it.
"""

from __future__ import annotations

import argparse

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        create_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
