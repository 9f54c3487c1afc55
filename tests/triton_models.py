"""Triton model repositories for the tests: Triton's own folders (tests/fixtures/triton) with the
models Triton's QA generates rather than ships built here, seeded, beside a nograd folder."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "triton"


class SumDifference(torch.nn.Module):
    """Triton's ``simple`` model as TorchScript: the sum and the difference of two tensors."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class ScaleShift(torch.nn.Module):
    """A model without a batch dimension, taking its input by name: ``2 * x + 1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x + 1


NO_BATCH_CONFIG = """
name: "scale_shift"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ 2, 3 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 2, 3 ] } ]
"""


def save_torchscript(module: torch.nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # torch deprecates TorchScript; Triton's PyTorch backend serves nothing else.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(module), str(path))


def fixed_shape_onnx(path: Path) -> None:
    """An ONNX model whose input has no variable first dimension (``Y = X + 1`` on [2, 3]):
    Triton's auto-complete gives it no batch dimension."""
    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "one"], ["Y"])],
        "fixed",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
        initializer=[one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))


AUTO_SIZED_CONFIG = """
name: "auto_sized"
platform: "onnxruntime_onnx"
max_batch_size: 8
"""
"""``simple``'s model with a batch size and nothing else: ONNX Runtime's auto-complete reads its
tensors from the graph and turns dynamic batching on."""


GUARDED_CONFIG = """
name: "guarded"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
version_policy: { all { } }
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""
GUARDED_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SCALE = {scale}


class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]
        self.batches = 0

    def execute(self, requests):
        self.batches += 1
        time.sleep(0.02)  # long enough for requests sent meanwhile to queue behind this one
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                code = pb_utils.TritonError.INVALID_ARG
                error = pb_utils.TritonError("X must not be negative", code)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif (x > 1000).any():
                error = pb_utils.TritonError("too large")
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                # How many requests this execute call took, in every row's second column.
                y = np.stack([x[:, 0] * SCALE, np.full(len(x), len(requests), np.float32)], 1)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
"""A Python-backend model written for these tests: an error response per bad request (400 for
INVALID_ARG, 500 for the default INTERNAL), and two versions whose ``model.py`` differ."""


PREPROCESS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "INPUT_0").as_numpy()
            # Each row's mean byte, scaled per channel, fills a 3 x 224 x 224 image.
            level = raw.astype(np.float32).mean(axis=1) / 255.0
            image = np.empty((len(raw), 3, 224, 224), np.float32)
            image[:] = (level[:, None] * np.array([1.0, 2.0, 3.0], np.float32))[:, :, None, None]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT_0", image)]))
        return responses
"""
"""Stands in for python_backend's preprocessing ``model.py`` (which decodes a JPEG with PIL and
torchvision): same tensors, numpy only."""


class PooledClassifier(torch.nn.Module):
    """Stands in for ``resnet50_trt`` (a TensorRT engine): 1000 scores from an image."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1000)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.linear(input.mean(dim=(2, 3)))


CLASSIFIER_CONFIG = """
name: "resnet50_trt"
platform: "pytorch_libtorch"
max_batch_size: 256
input [ { name: "input", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] } ]
output [ { name: "output", data_type: TYPE_FP32, dims: [ 1000 ] } ]
"""

CHAIN_CONFIG = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "A", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "B", data_type: TYPE_FP32, dims: [ 4 ] }
]
output [
  { name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "TWICE_B", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "THRICE_A_PLUS_B", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "B_MINUS_A", data_type: TYPE_FP32, dims: [ 4 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "add_sub"
      model_version: -1
      input_map { key: "INPUT0" value: "A" }
      input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "SUM" }
      output_map { key: "OUTPUT1" value: "diff" }
    },
    {
      model_name: "pytorch"
      model_version: -1
      input_map { key: "INPUT0" value: "SUM" }
      input_map { key: "INPUT1" value: "diff" }
      output_map { key: "OUTPUT0" value: "twice_a" }
      output_map { key: "OUTPUT1" value: "TWICE_B" }
    },
    {
      model_name: "add_sub"
      model_version: 1
      input_map { key: "INPUT0" value: "SUM" }
      input_map { key: "INPUT1" value: "twice_a" }
      output_map { key: "OUTPUT0" value: "THRICE_A_PLUS_B" }
      output_map { key: "OUTPUT1" value: "B_MINUS_A" }
    }
  ]
}
"""
"""No batch dimension, over python_backend's two examples: ``SUM`` (A + B) is an ensemble output
and the input of two later steps."""

TWICE_CONFIG = """
name: "guarded_twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "guarded"
      model_version: 1
      input_map { key: "X" value: "X" }
      output_map { key: "Y" value: "once" }
    },
    {
      model_name: "guarded"
      model_version: 2
      input_map { key: "X" value: "once" }
      output_map { key: "Y" value: "Y" }
    }
  ]
}
"""
"""Versions 1 and 2 of ``guarded`` in turn (dynamic batching, 20 ms): ``Y[:, 0] = 10 * X[:, 0]``."""

SIMPLE_ENSEMBLE_CONFIG = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [
  {{ name: "IN0", data_type: TYPE_INT32, dims: [ 16 ] }},
  {{ name: "IN1", data_type: TYPE_INT32, dims: [ 16 ] }}
]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 16 ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "{step}"
      model_version: -1
      input_map {{ key: "{input}" value: "IN0" }}
      input_map {{ key: "INPUT1" value: "IN1" }}
      output_map {{ key: "OUTPUT0" value: "OUT" }}
    }}
  ]
}}
"""

AUTO_COMPLETE_ENSEMBLE_CONFIG = """
name: "auto_complete_twice"
platform: "ensemble"
max_batch_size: 4
input [
  { name: "A", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "B", data_type: TYPE_FP32, dims: [ 4 ] }
]
output [
  { name: "TWICE_A", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "TWICE_B", data_type: TYPE_FP32, dims: [ 4 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "batch_auto_complete"
      model_version: -1
      input_map { key: "INPUT0" value: "A" }
      input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "sum" }
      output_map { key: "OUTPUT1" value: "difference" }
    },
    {
      model_name: "batch_auto_complete"
      model_version: -1
      input_map { key: "INPUT0" value: "sum" }
      input_map { key: "INPUT1" value: "difference" }
      output_map { key: "OUTPUT0" value: "TWICE_A" }
      output_map { key: "OUTPUT1" value: "TWICE_B" }
    }
  ]
}
"""
"""Two steps on python_backend's ``batch_auto_complete`` (no config.pbtxt: its tensors and batch
size come from its ``auto_complete_config``): the sum and difference of their sum and
difference, ``2 * A`` and ``2 * B``."""


WARMED_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 2 ] }} ]
model_warmup [
  {{
    name: "{sample}"
    batch_size: 2
    count: 2
    inputs {{ key: "X" value: {{ data_type: TYPE_FP32 dims: [ 2 ] {data} }} }}
  }}
]
"""
WARMED_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if not x.any():
                error = pb_utils.TritonError("An Error Occurred")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            self.seen.append(float(x.sum()))
            # Every input sum this model saw before, warmup's included, in the first row.
            y = np.zeros_like(x)
            y[0, : min(2, len(self.seen))] = self.seen[:2]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
"""Python models with ``model_warmup``: ``warmed`` reads its sample from ``warmup/x`` (1.5 and
2.5) and answers with the sums it saw first (the warmup's); ``warm_failing`` sends zeros, which
the model answers with an error, so it does not load."""


OPTIONAL_CONFIG = """
name: "optional_sum"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 50000 }
input [
  { name: "A", data_type: TYPE_FP32, dims: [ 2 ] },
  { name: "B", data_type: TYPE_FP32, dims: [ 2 ], optional: true }
]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
"""
OPTIONAL_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05)  # long enough for the requests sent meanwhile to queue
        given = [pb_utils.get_input_tensor_by_name(r, "B") is not None for r in requests]
        mixed = float(len(set(given)) > 1)
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B")
            total = a[:, 0] + (b.as_numpy()[:, 0] if b is not None else 0)
            # The sum, then how many requests this execute took (negative: with and without B).
            took = -len(requests) if mixed else len(requests)
            y = np.stack([total, np.full(len(a), took, np.float32)], 1).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
"""A Python model with an optional input ``B``: ``Y[:, 0] = A[:, 0] + B[:, 0]`` (B left out:
A alone), ``Y[:, 1]`` the number of requests its execute took, negative when they were with
and without B together."""


TALLY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
sequence_batching {{
{strategy}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
    {corrid}
  ]
}}
input [ {{ name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] }},
  {{ name: "CONTROLS", data_type: TYPE_INT32, dims: [ 5 ] }}
]
"""
CORRID_CONTROL = (
    ', {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {} }} ] }}'
)
TALLY_STRATEGIES = {
    "tally": (
        "  max_sequence_idle_microseconds: 60000000\n"
        "  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }",
        CORRID_CONTROL.format("TYPE_UINT64"),
    ),
    "tally_named": ("", ""),
    "tally_string_corrid": ("", CORRID_CONTROL.format("TYPE_STRING")),
}
"""``tally``: the oldest strategy, a CORRID control of numbers; ``tally_named``: everything
Triton completes left out (the strategy, the idle time) and no CORRID control, for string ids;
``tally_string_corrid``: a CORRID of strings, whose configuration only is compared (Triton 2.51
refuses every request to it: 'unexpected number of string elements 2 for inference input
'CORRID', expecting 1')."""
TALLY_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


SHAPES = (("OUTPUT", 1), ("CONTROLS", 5))


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def read(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            x = read("INPUT")
            start, end, ready = (int(read(name)[0, 0]) for name in ("START", "END", "READY"))
            if not ready:  # the direct strategy fills a batch's idle slots with such requests
                outputs = [pb_utils.Tensor(n, np.zeros((1, d), np.int32)) for n, d in SHAPES]
                responses.append(pb_utils.InferenceResponse(outputs))
                continue
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID")
            key = request.correlation_id() if corrid is None else int(corrid.as_numpy()[0, 0])
            total = x if start else self.sums[key] + x
            self.sums[key] = total
            if end:
                del self.sums[key]
            # The controls the server fed, the request's flags, and whether CORRID is its id.
            same = int(key == request.correlation_id())
            controls = np.array([[start, end, ready, request.flags(), same]], np.int32)
            outputs = [pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("CONTROLS", controls)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""
"""A Python sequence model keeping each sequence's running sum itself, keyed by the CORRID
control or else ``request.correlation_id()`` (a number or a string): ``OUTPUT`` is the sum so
far (START: the input alone); ``CONTROLS`` holds the START, END and READY controls,
``request.flags()`` and 1 where the key is the request's correlation id."""


def triton_repository(root: Path) -> Path:
    """Triton folders and a nograd one side by side:

    - ``simple`` (Triton's, ONNX) with versions 1 and 2: the default policy serves 2 alone;
    - ``simple_int8`` (Triton's, ONNX);
    - ``simple_string`` (Triton's, ONNX with TYPE_STRING tensors), and ``simple_string_queued``,
      the same with dynamic batching (a 200 ms delay, so concurrent requests share a batch);
    - ``simple_specific``: ``simple`` with versions 1 to 3 and a policy serving 1 and 3;
    - ``cpu_instance`` (Triton's QA config) with a generated TorchScript ``model.pt``;
    - ``sum_chosen``: ``cpu_instance`` opted in to nograd's engine choice (``nograd_engine``:
      ONNX Runtime, built from the TorchScript model and checked against it);
    - ``scale_shift``: TorchScript without a batch dimension;
    - ``auto``: ``simple``'s model.onnx with no config (auto-complete: batched, 4 rows), and
      ``auto_sized``, the same with a config giving only ``max_batch_size`` 8;
    - ``fixed``: a fixed-shape ONNX model with no config (auto-complete: no batch dimension);
    - ``unsupported``: ``simple`` with an iterative ``sequence_batching``: refused, naming the
      field;
    - ``simple_identity`` (Triton's, the Python backend, TYPE_STRING), python_backend's
      ``add_sub`` and ``pytorch`` examples, its ``auto_complete`` example's
      ``batch_auto_complete`` and ``nobatch_auto_complete`` (a ``1/model.py`` alone, no
      config.pbtxt) with ``auto_complete_twice``, an ensemble over the first, and ``guarded`` (a
      Python model with error responses and two versions);
    - ensembles: python_backend's ``ensemble_python_resnet50`` (its ``preprocess`` config, with
      a numpy ``model.py``, and a TorchScript ``resnet50_trt``), ``chain`` (no batch dimension),
      ``guarded_twice`` (batched), ``simple_ensemble`` over ``simple_step`` (a copy of
      ``simple``), ``lazy_ensemble`` over ``lazy_step`` (neither loaded at start-up), and two
      that fail to load: ``ensemble_missing`` (a step model not in the
      repository) and ``ensemble_bad_input`` (an input ``simple`` does not have);
    - ``warmed`` and ``warm_failing`` (Python, ``model_warmup``, the second failing), and
      ``simple_warm_short`` (``simple`` with a warmup file too short), the last two not loaded
      at start-up;
    - ``optional_sum`` (Python, an optional input);
    - ``tally``, ``tally_named`` and ``tally_string_corrid`` (Python sequence models: the oldest
      strategy with a numeric CORRID, direct with string ids, a string CORRID);
    - ``digits``: nograd's own folder.
    """
    torch.manual_seed(0)
    repo = root / "repo"
    repo.mkdir(parents=True)
    simple = FIXTURES / "simple"
    for name in ("simple", "simple_int8", "simple_identity", "simple_string"):
        shutil.copytree(FIXTURES / name, repo / name)
    queued = repo / "simple_string_queued"
    shutil.copytree(FIXTURES / "simple_string" / "1", queued / "1")
    strings = (FIXTURES / "simple_string" / "config.pbtxt").read_text()
    (queued / "config.pbtxt").write_text(
        strings.replace('"simple_string"', '"simple_string_queued"')
        + "\ndynamic_batching { max_queue_delay_microseconds: 200000 }\n"
    )
    shutil.copytree(simple / "1", repo / "simple" / "2")
    specific = repo / "simple_specific"
    for version in ("1", "2", "3"):
        shutil.copytree(simple / "1", specific / version)
    text = (simple / "config.pbtxt").read_text().replace('"simple"', '"simple_specific"')
    (specific / "config.pbtxt").write_text(
        text + "\nversion_policy: { specific: { versions: [ 1, 3 ] } }\n"
    )
    unsupported = repo / "unsupported"
    shutil.copytree(simple / "1", unsupported / "1")
    (unsupported / "config.pbtxt").write_text(
        text.replace('"simple_specific"', '"unsupported"')
        + "\nsequence_batching { iterative_sequence: true }\n"
    )
    shutil.copytree(FIXTURES / "cpu_instance", repo / "cpu_instance")
    save_torchscript(SumDifference(), repo / "cpu_instance" / "1" / "model.pt")
    chosen = repo / "sum_chosen"
    save_torchscript(SumDifference(), chosen / "1" / "model.pt")
    (chosen / "config.pbtxt").write_text(
        (FIXTURES / "cpu_instance" / "config.pbtxt")
        .read_text()
        .replace("cpu_instance", "sum_chosen")
        + '\nparameters { key: "nograd_engine" value: { string_value: "onnx" } }\n'
    )
    save_torchscript(ScaleShift(), repo / "scale_shift" / "1" / "model.pt")
    (repo / "scale_shift" / "config.pbtxt").write_text(NO_BATCH_CONFIG)
    shutil.copytree(simple / "1", repo / "auto" / "1")
    shutil.copytree(simple / "1", repo / "auto_sized" / "1")
    (repo / "auto_sized" / "config.pbtxt").write_text(AUTO_SIZED_CONFIG)
    fixed_shape_onnx(repo / "fixed" / "1" / "model.onnx")
    for name in ("add_sub", "pytorch", "batch_auto_complete", "nobatch_auto_complete"):
        shutil.copytree(FIXTURES / name, repo / name)
    (repo / "auto_complete_twice" / "1").mkdir(parents=True)
    (repo / "auto_complete_twice" / "config.pbtxt").write_text(AUTO_COMPLETE_ENSEMBLE_CONFIG)
    (repo / "guarded").mkdir()
    (repo / "guarded" / "config.pbtxt").write_text(GUARDED_CONFIG)
    for version, scale in (("1", 1), ("2", 10)):
        (repo / "guarded" / version).mkdir()
        (repo / "guarded" / version / "model.py").write_text(GUARDED_MODEL.format(scale=scale))
    _ensembles(repo)
    _warmed(repo)
    (repo / "optional_sum" / "1").mkdir(parents=True)
    (repo / "optional_sum" / "config.pbtxt").write_text(OPTIONAL_CONFIG)
    (repo / "optional_sum" / "1" / "model.py").write_text(OPTIONAL_MODEL)
    for name, (strategy, corrid) in TALLY_STRATEGIES.items():
        (repo / name / "1").mkdir(parents=True)
        config = TALLY_CONFIG.format(name=name, strategy=strategy, corrid=corrid)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(TALLY_MODEL)
    shutil.copytree(ROOT / "models" / "digits", repo / "digits")
    digits = repo / "digits" / "config.toml"  # eager: no engine built at every start
    digits.write_text(digits.read_text().replace('engine = "auto"', 'engine = "eager"'))
    return repo


def _warmed(repo: Path) -> None:
    for name, sample, data in (
        ("warmed", "from file", 'input_data_file: "x"'),
        ("warm_failing", "zero sample", "zero_data: true"),
    ):
        (repo / name / "1").mkdir(parents=True)
        config = WARMED_CONFIG.format(name=name, sample=sample, data=data)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(WARMED_MODEL)
    (repo / "warmed" / "warmup").mkdir()
    (repo / "warmed" / "warmup" / "x").write_bytes(np.array([1.5, 2.5], "<f4").tobytes())
    warm_onnx = repo / "simple_warm_short"
    shutil.copytree(FIXTURES / "simple" / "1", warm_onnx / "1")
    text = (
        (FIXTURES / "simple" / "config.pbtxt")
        .read_text()
        .replace('"simple"', '"simple_warm_short"')
    )
    (warm_onnx / "config.pbtxt").write_text(
        text
        + """
model_warmup [{
  name: "short file" batch_size: 8
  inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] input_data_file: "in" } }
  inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
}]
"""
    )
    (warm_onnx / "warmup").mkdir()
    (warm_onnx / "warmup" / "in").write_bytes(b"\0" * 32)


def _ensembles(repo: Path) -> None:
    for name in ("ensemble_python_resnet50", "preprocess"):
        shutil.copytree(FIXTURES / name, repo / name)
    (repo / "ensemble_python_resnet50" / "1").mkdir()
    (repo / "preprocess" / "1").mkdir()
    (repo / "preprocess" / "1" / "model.py").write_text(PREPROCESS_MODEL)
    save_torchscript(PooledClassifier(), repo / "resnet50_trt" / "1" / "model.pt")
    (repo / "resnet50_trt" / "config.pbtxt").write_text(CLASSIFIER_CONFIG)
    for step in ("simple_step", "lazy_step"):
        shutil.copytree(FIXTURES / "simple", repo / step)
        text = (repo / step / "config.pbtxt").read_text()
        (repo / step / "config.pbtxt").write_text(text.replace('"simple"', f'"{step}"'))
    configs = {
        "chain": CHAIN_CONFIG,
        "guarded_twice": TWICE_CONFIG,
        "simple_ensemble": SIMPLE_ENSEMBLE_CONFIG.format(
            name="simple_ensemble", step="simple_step", input="INPUT0"
        ),
        "lazy_ensemble": SIMPLE_ENSEMBLE_CONFIG.format(
            name="lazy_ensemble", step="lazy_step", input="INPUT0"
        ),
        "ensemble_missing": SIMPLE_ENSEMBLE_CONFIG.format(
            name="ensemble_missing", step="nowhere", input="INPUT0"
        ),
        "ensemble_bad_input": SIMPLE_ENSEMBLE_CONFIG.format(
            name="ensemble_bad_input", step="simple", input="NOPE"
        ),
    }
    for name, config in configs.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)


SERVED = (
    "simple",
    "simple_int8",
    "simple_string",
    "simple_string_queued",
    "simple_specific",
    "cpu_instance",
    "sum_chosen",
    "scale_shift",
    "auto",
    "auto_sized",
    "simple_identity",
    "add_sub",
    "pytorch",
    "batch_auto_complete",
    "nobatch_auto_complete",
    "auto_complete_twice",
    "guarded",
    "preprocess",
    "resnet50_trt",
    "ensemble_python_resnet50",
    "simple_step",
    "simple_ensemble",
    "chain",
    "guarded_twice",
    "warmed",
    "optional_sum",
    "tally",
    "tally_named",
    "tally_string_corrid",
)
"""The Triton models the e2e server loads at start-up (with ``fixed`` and ``digits``)."""
