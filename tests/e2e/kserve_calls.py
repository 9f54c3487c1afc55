"""KServe's client calls against a nograd gRPC address, printed as one JSON document.

Run as its own process (``python -m tests.e2e.kserve_calls HOST:PORT``): KServe's V2 proto and
Triton's (tritonclient, nograd) define the same ``inference.*`` messages from different files, and
protobuf refuses to hold both in one process's descriptor pool.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from kserve.inference_client import InferenceGRPCClient
from kserve.protocol.grpc import grpc_predict_v2_pb2 as kserve_pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = json.loads((ROOT / "models/digits/sample.json").read_text())["inputs"][0]
IMAGES = np.asarray(SAMPLE["data"], dtype=np.float32).reshape(SAMPLE["shape"])


def _tensors(metadata: Any) -> list[list[Any]]:
    return [[t.name, t.datatype, list(t.shape)] for t in metadata]


async def _infer(client: InferenceGRPCClient, raw: bool) -> dict[str, Any]:
    """Raw: ``set_data_from_numpy`` sends ``raw_input_contents``; typed: a list as ``data`` goes
    in ``contents.fp32_contents``."""
    if raw:
        image = InferInput("image", list(IMAGES.shape), "FP32")
        image.set_data_from_numpy(IMAGES)
    else:
        image = InferInput("image", list(IMAGES.shape), "FP32", data=IMAGES.ravel().tolist())
    request = InferRequest(model_name="digits", infer_inputs=[image], request_id=f"kserve-{raw}")
    response = await client.infer(request)
    return {
        "id": response.id,
        "model_name": response.model_name,
        "outputs": {
            o.name: {"shape": list(o.as_numpy().shape), "data": o.as_numpy().ravel().tolist()}
            for o in response.outputs
        },
    }


async def calls(address: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    async with InferenceGRPCClient(address, timeout=30) as client:
        found["live"] = await client.is_server_live()
        found["ready"] = await client.is_server_ready()
        found["models_ready"] = {
            name: await client.is_model_ready(name) for name in ("digits", "minilm", "nope")
        }
        found["raw"] = await _infer(client, raw=True)
        found["typed"] = await _infer(client, raw=False)
        image = InferInput("image", list(IMAGES.shape), "FP32")
        image.set_data_from_numpy(IMAGES)
        request = InferRequest(
            model_name="digits", infer_inputs=[image], request_outputs=[RequestedOutput("label")]
        )
        found["label_only"] = [o.name for o in (await client.infer(request)).outputs]
    # The client has no metadata call: KServe's own generated stub, on a channel of our own.
    async with grpc.aio.insecure_channel(address) as channel:
        stub = GRPCInferenceServiceStub(channel)
        model = await stub.ModelMetadata(kserve_pb.ModelMetadataRequest(name="digits"), timeout=30)
        server = await stub.ServerMetadata(kserve_pb.ServerMetadataRequest(), timeout=30)
        try:
            await stub.ModelMetadata(kserve_pb.ModelMetadataRequest(name="nope"), timeout=30)
            found["unknown_model"] = "OK"
        except grpc.aio.AioRpcError as exc:
            found["unknown_model"] = exc.code().name
    found["metadata"] = {
        "name": model.name,
        "versions": list(model.versions),
        "platform": model.platform,
        "inputs": _tensors(model.inputs),
        "outputs": _tensors(model.outputs),
    }
    found["server"] = {"name": server.name, "version": server.version}
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(calls(sys.argv[1]))))
