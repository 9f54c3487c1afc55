"""Baseline (c): LitServe with its own dynamic batching, serving the same model and pooling.

Same route and JSON shape as nograd's V2 infer. ``decode_request`` reads the V2 body,
``batch`` concatenates the requests (remembering each one's row count, so a request of 8
sentences gets its 8 rows back), ``predict`` runs one forward under ``torch.inference_mode()``
(tokenising the whole batch first for minilm), ``unbatch`` cuts the rows per request.
One inference worker on the CPU, LitServe's defaults otherwise. ``--packed`` runs minilm through
nograd's ``PackedEncoder`` instead of transformers' ``BertModel``: the same forward nograd runs,
so the two servers can be compared on the serving alone.
"""

import argparse
from typing import Any

import litserve as ls
import numpy as np
import torch

from bench.models import Digits, MiniLM, load


class V2API(ls.LitAPI):  # type: ignore[misc]
    def __init__(
        self, model_name: str, max_batch_size: int, batch_timeout: float, packed: bool = False
    ) -> None:
        super().__init__(
            max_batch_size=max_batch_size,
            batch_timeout=batch_timeout,
            api_path=f"/v2/models/{model_name}/infer",
        )
        self.model_name = model_name
        self.packed = packed
        self.model: Digits | MiniLM | None = None

    def setup(self, device: str) -> None:
        del device
        self.model = load(self.model_name, packed=self.packed)

    # No annotation on purpose: LitServe reads it to choose how to parse the body, and an
    # unannotated request is its default path (Starlette's ``request.json()``).
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        assert self.model is not None
        return self.model.parse(request)

    def batch(self, inputs: list[Any]) -> tuple[Any, list[int]]:
        counts = [len(item) for item in inputs]
        if isinstance(self.model, Digits):
            return np.concatenate(inputs), counts
        return [text for item in inputs for text in item], counts

    def predict(self, x: tuple[Any, list[int]]) -> tuple[dict[str, torch.Tensor], list[int]]:
        data, counts = x
        with torch.inference_mode():
            if isinstance(self.model, Digits):
                return self.model.forward(torch.from_numpy(data)), counts
            assert isinstance(self.model, MiniLM)
            return self.model.embed(data), counts

    def unbatch(self, output: tuple[dict[str, torch.Tensor], list[int]]) -> list[Any]:
        outputs, counts = output
        pieces: list[dict[str, torch.Tensor]] = []
        start = 0
        for count in counts:
            pieces.append({name: t[start : start + count] for name, t in outputs.items()})
            start += count
        return pieces

    def encode_response(self, output: dict[str, torch.Tensor]) -> dict[str, Any]:
        assert self.model is not None
        return self.model.response(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("digits", "minilm"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-timeout", type=float, default=0.005)
    parser.add_argument("--packed", action="store_true", help="minilm: nograd's packed forward")
    args = parser.parse_args()
    api = V2API(args.model, args.max_batch_size, args.batch_timeout, args.packed)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=30)
    server.run(
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        generate_client_file=False,
        num_api_servers=1,
    )


if __name__ == "__main__":
    main()
