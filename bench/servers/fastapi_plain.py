"""Baseline (b): a plain FastAPI endpoint, one forward per request under ``torch.no_grad()``.

What most teams write first: a pydantic request model, the forward inline, a dict returned for
FastAPI to serialise. Same route and JSON shape as nograd's V2 infer. One uvicorn worker.
``--sync`` declares the endpoint with ``def`` instead (FastAPI then runs it in its thread pool,
so several forwards overlap and share torch's threads).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from bench.models import Digits, MiniLM, load


class InputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


class InferRequest(BaseModel):
    inputs: list[InputTensor]


def create_app(model_name: str, sync: bool) -> FastAPI:
    model = load(model_name)
    app = FastAPI()

    def run(request: InferRequest) -> dict[str, Any]:
        document = request.model_dump()
        with torch.no_grad():
            if isinstance(model, Digits):
                images = torch.from_numpy(model.parse(document))
                return model.response(model.forward(images))
            assert isinstance(model, MiniLM)
            return model.response(model.embed(model.parse(document)))

    path = f"/v2/models/{model_name}/infer"
    if sync:

        @app.post(path)
        def infer_sync(request: InferRequest) -> dict[str, Any]:
            return run(request)
    else:

        @app.post(path)
        async def infer_async(request: InferRequest) -> dict[str, Any]:
            return run(request)

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("digits", "minilm"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sync", action="store_true")
    args = parser.parse_args()
    app = create_app(args.model, args.sync)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
