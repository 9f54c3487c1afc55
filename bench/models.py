"""The shipped models as the baselines load them: the same code, weights and pooling as nograd.

``models/digits/model.py`` and ``models/minilm/model.py`` are imported by file path (as nograd's
loader does), digits' weights come from its safetensors file with ``strict=True``, and minilm uses
that file's own tokenizer, BERT loader and ``mean_pool_normalise``. Nothing here is nograd's
serving code: the baselines must not borrow its batcher or codec.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from bench.common import ROOT

MODELS = ROOT / "models"


def import_file(path: Path, name: str) -> ModuleType:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def v2_response(
    model: str, specs: tuple[tuple[str, str], ...], outputs: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The V2 answer nograd gives, so every baseline sends the same JSON shape back."""
    return {
        "model_name": model,
        "model_version": "1",
        "outputs": [
            {
                "name": name,
                "datatype": datatype,
                "shape": list(outputs[name].shape),
                "data": outputs[name].reshape(-1).tolist(),
            }
            for name, datatype in specs
        ],
    }


class Digits:
    """The digits CNN: ``[n, 1, 8, 8]`` raw pixels in, logits / probabilities / label out."""

    name = "digits"

    def __init__(self) -> None:
        code = import_file(MODELS / "digits" / "model.py", "bench_models_digits")
        module: torch.nn.Module = code.build(MODELS / "digits")
        module.load_state_dict(load_file(str(MODELS / "digits" / "model.safetensors")), strict=True)
        module.eval()
        for parameter in module.parameters():
            parameter.requires_grad_(False)
        self.module = module

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = self.module(images)
        return out

    @staticmethod
    def parse(document: dict[str, Any]) -> np.ndarray:
        tensor = document["inputs"][0]
        return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])

    @staticmethod
    def response(outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        specs = (("logits", "FP32"), ("probabilities", "FP32"), ("label", "INT64"))
        return v2_response("digits", specs, outputs)


class MiniLM:
    """all-MiniLM-L6-v2 through ``models/minilm/model.py``: tokenizer, BERT, mean pool, L2 norm."""

    name = "minilm"

    def __init__(self, packed: bool = False) -> None:
        """``packed``: ``forward`` runs nograd's ``PackedEncoder`` (padding skipped) instead of
        transformers' ``BertModel``, so a baseline server can be measured on the same forward."""
        self.use_packed = packed
        code = import_file(MODELS / "minilm" / "model.py", "bench_models_minilm")
        source = code.package_model_dir()
        self.max_length = int(code.max_seq_length(source))
        self.tokenizer = code.load_tokenizer(source, self.max_length)
        self.bert = code.load_bert(source)
        for parameter in self.bert.parameters():
            parameter.requires_grad_(False)
        self._pool = code.mean_pool_normalise
        self._token_tensors: tuple[str, ...] = code.TOKEN_TENSORS
        self._packed_encoder: Callable[[Any, Any], torch.nn.Module] = code.PackedEncoder

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        return {
            "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.int64),
            "attention_mask": torch.tensor(
                [e.attention_mask for e in encodings], dtype=torch.int64
            ),
            "token_type_ids": torch.tensor([e.type_ids for e in encodings], dtype=torch.int64),
        }

    def forward(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = tokens["attention_mask"]
        if self.use_packed:
            embedding = self.forward_packed(tokens)
        else:
            embedding = self._pool(self.bert(**tokens).last_hidden_state, mask)
        return {"embedding": embedding, "token_count": mask.sum(dim=1, keepdim=True)}

    @functools.cached_property
    def packed(self) -> torch.nn.Module:
        """nograd's forward of the same weights (padding skipped), built on first use only, so
        a baseline serving ``BertModel`` does not hold a second copy of the weights."""
        return self._packed_encoder(self.bert.config.to_dict(), self.bert.state_dict()).eval()

    def forward_packed(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        embedding: torch.Tensor = self.packed(*(tokens[name] for name in self._token_tensors))
        return embedding

    def embed(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.forward(self.tokenize(texts))

    @staticmethod
    def parse(document: dict[str, Any]) -> list[str]:
        return [str(text) for text in document["inputs"][0]["data"]]

    @staticmethod
    def response(outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        specs = (("embedding", "FP32"), ("token_count", "INT64"))
        return v2_response("minilm", specs, outputs)


def load(name: str, packed: bool = False) -> Digits | MiniLM:
    if name == "digits":
        return Digits()
    if name == "minilm":
        return MiniLM(packed=packed)
    raise ValueError(f"unknown model {name!r}")
