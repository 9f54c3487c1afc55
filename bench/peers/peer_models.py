"""The shipped models as a peer server loads them, with nothing from nograd or the main venv.

Peer servers run in their own virtual environments (``bench/peers/envs.py``), which hold torch,
tokenizers, transformers and safetensors but not nograd; ``models/minilm/model.py`` imports
``nograd.sdk``, so the minilm pipeline is spelled out here instead: the package's
``tokenizer.json`` truncating at sentence-transformers' 256 tokens and padding to the longest
text, transformers' ``BertModel`` on the same ``model.safetensors``, mean pooling over the
attention mask and L2 normalisation (what sentence-transformers and nograd compute). digits
imports ``models/digits/model.py`` by path (it needs torch only) and loads its safetensors
strictly. Each peer server imports this file by path, so it must stay importable on its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Final

# Set before transformers is imported anywhere: the weights are local and the hub unreachable.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

ROOT: Final = Path(__file__).resolve().parents[2]
DIGITS_DIR: Final = ROOT / "models" / "digits"
EMBEDDING_WIDTH: Final = 384
DIGITS_OUTPUTS: Final = ("logits", "probabilities", "label")


def _import_path(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DigitsModel:
    """The digits CNN: ``[n, 1, 8, 8]`` FP32 raw pixels in; logits, probabilities, label out."""

    def __init__(self, model_dir: Path = DIGITS_DIR) -> None:
        from safetensors.torch import load_file

        code = _import_path(model_dir / "model.py", "peer_digits_model")
        module: torch.nn.Module = code.build(model_dir)
        module.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=True)
        self.module = module.eval().requires_grad_(False)

    def predict(self, images: np.ndarray) -> dict[str, np.ndarray]:
        batch = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
        with torch.inference_mode():
            outputs = self.module(batch)
        return {name: outputs[name].numpy() for name in DIGITS_OUTPUTS}


class MiniLMModel:
    """all-MiniLM-L6-v2 from the package folder: texts in, ``[n, 384]`` unit vectors out."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer
        from transformers import BertModel

        settings = json.loads((model_dir / "sentence_bert_config.json").read_text("utf-8"))
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        # The shipped tokenizer.json pads and truncates at a fixed 128; sentence-transformers
        # truncates at max_seq_length and pads each call to its longest text.
        tokenizer.enable_truncation(max_length=int(settings["max_seq_length"]))
        pad_id = tokenizer.token_to_id("[PAD]")
        tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
        self.tokenizer = tokenizer
        bert: torch.nn.Module = BertModel.from_pretrained(str(model_dir), local_files_only=True)
        self.bert = torch.nn.Module.eval(bert).requires_grad_(False)

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        return {
            "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.int64),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
            "token_type_ids": torch.tensor([e.type_ids for e in encodings], dtype=torch.int64),
        }

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.encode(texts)[0]

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``[n, 384]`` embeddings and ``[n, 1]`` token counts (what nograd answers), from one
        tokenisation."""
        if not texts:
            return np.zeros((0, EMBEDDING_WIDTH), np.float32), np.zeros((0, 1), np.int64)
        tokens = self.tokenize(texts)
        with torch.inference_mode():
            hidden = self.bert(**tokens).last_hidden_state
            pooled = mean_pool_normalise(hidden, tokens["attention_mask"])
        counts = tokens["attention_mask"].sum(dim=1, keepdim=True).to(torch.int64)
        return pooled.numpy(), counts.numpy()


def mean_pool_normalise(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the vectors of the real tokens (mask 1), then scale to unit length."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed / counts, p=2, dim=1)


def texts_of(values: Any) -> list[str]:
    """UTF-8 texts from what a server hands over: bytes (Triton's BYTES) or str (JSON)."""
    flat = np.asarray(values, dtype=object).reshape(-1)
    return [v.decode("utf-8") if isinstance(v, bytes | bytearray) else str(v) for v in flat]
