"""The peer servers' plumbing that needs no network and no peer install.

A wrong body format would make a peer answer 400s the bench counts as errors, a wrong answer check
would let a peer's numbers count while it computes something else, and a broken stamp would
reinstall several GB of packages on every run or keep a stale venv; these tests pin each of them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from bench.peers import check, envs, infinity_server, protocol, servers, torchserve_server
from bench.peers.peer_models import texts_of
from bench.workloads import make

PEERS_PACKAGE = Path(__file__).resolve().parents[3] / "bench" / "peers"


# ----------------------------------------------------------------------------- routes and bodies
@pytest.mark.parametrize(
    ("system", "workload", "path", "body_format"),
    [
        ("pytriton", "digits", "/v2/models/digits/infer", "v2"),
        ("pytriton", "minilm-1", "/v2/models/minilm/infer", "v2-column"),
        ("pytriton", "minilm-8", "/v2/models/minilm/infer", "v2-column"),
        ("torchserve", "digits", "/v2/models/digits/infer", "v2"),
        ("torchserve", "minilm-8", "/v2/models/minilm/infer", "v2"),
        ("infinity-torch", "minilm-1", "/embeddings", "openai"),
        ("infinity-onnx", "minilm-8", "/embeddings", "openai"),
    ],
)
def test_each_peer_has_its_route(system: str, workload: str, path: str, body_format: str) -> None:
    assert protocol.route(system, workload) == protocol.Route(path, body_format)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("system", "workload"),
    [("infinity-onnx", "digits"), ("nothing", "minilm-1"), ("pytriton", "x")],
)
def test_a_pair_no_peer_serves_is_refused(system: str, workload: str) -> None:
    with pytest.raises(ValueError):
        protocol.route(system, workload)


def test_v2_column_puts_the_batch_dimension_in_front_of_text_only() -> None:
    text = make("minilm-8", 2).bodies[0]
    column = orjson.loads(protocol.convert_body(text, "v2-column"))
    original = orjson.loads(text)
    assert column["inputs"][0]["shape"] == [8, 1]
    assert column["inputs"][0]["data"] == original["inputs"][0]["data"]
    assert column["inputs"][0]["name"] == "text"
    digits = make("digits", 1).bodies[0]
    assert orjson.loads(protocol.convert_body(digits, "v2-column")) == orjson.loads(digits)
    assert protocol.convert_body(digits, "v2") is digits


def test_openai_body_carries_the_same_sentences() -> None:
    for body in make("minilm-8", 3).bodies:
        document = orjson.loads(protocol.convert_body(body, "openai"))
        assert document == {"model": "minilm", "input": protocol.request_texts(body)}
    with pytest.raises(ValueError):
        protocol.convert_body(make("digits", 1).bodies[0], "openai")


def test_peer_bodies_are_written_one_per_line_like_the_workloads(tmp_path: Path) -> None:
    workload = make("minilm-1", 5)
    path = protocol.write_peer_bodies(workload, "openai", tmp_path)
    lines = path.read_bytes().splitlines()
    assert path.name == "bodies-minilm-1-openai.txt"
    assert len(lines) == 5
    assert [orjson.loads(line)["input"] for line in lines] == [
        protocol.request_texts(body) for body in workload.bodies
    ]
    assert protocol.write_peer_bodies(workload, "v2", tmp_path).read_bytes().splitlines() == list(
        workload.bodies
    )


def test_answers_are_read_in_row_order() -> None:
    openai = orjson.dumps(
        {"data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}]}
    )
    assert protocol.answer_embeddings(openai, "openai").tolist() == [[1.0, 0.0], [0.0, 1.0]]
    v2 = orjson.dumps(
        {
            "outputs": [
                {"name": "embedding", "datatype": "FP32", "shape": [2, 2], "data": [1, 0, 0, 1]},
                {"name": "token_count", "datatype": "INT64", "shape": [2, 1], "data": [3, 4]},
            ]
        }
    )
    outputs = protocol.answer_outputs(v2)
    assert outputs["token_count"].dtype == np.int64
    assert protocol.answer_embeddings(v2, "v2-column").shape == (2, 2)


# ----------------------------------------------------------------------------- answer check maths
def test_row_cosines() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    b = np.array([[2.0, 0.0], [-1.0, -1.0], [1.0, 0.0]])
    assert check.row_cosines(a, b).tolist() == pytest.approx([1.0, -1.0, 0.0])
    with pytest.raises(ValueError):
        check.row_cosines(a, b[:2])


def test_embeddings_pass_only_above_the_cosine_floor() -> None:
    rng = np.random.default_rng(0)
    want = rng.normal(size=(4, 384))
    close = want + rng.normal(scale=1e-3, size=want.shape)
    verdict = check.judge_embeddings("p", "minilm-1", [(close, want)])
    assert verdict.passed and verdict.min_cosine is not None and verdict.min_cosine > 0.999
    cls_pooled = want.copy()
    cls_pooled[2] = rng.normal(size=384)
    failed = check.judge_embeddings("p", "minilm-1", [(close, want), (cls_pooled, want)])
    assert not failed.passed and "min cosine" in failed.detail


def test_digits_need_close_values_and_the_same_argmax() -> None:
    logits = np.array([[0.1, 2.0, 0.3] + [0.0] * 7])
    probabilities = np.exp(logits) / np.exp(logits).sum()
    want = {"logits": logits, "probabilities": probabilities}
    label = np.array([[1]])
    same = {"logits": logits + 1e-6, "probabilities": probabilities, "label": label}
    assert check.judge_digits("p", "digits", [(same, want)]).passed
    off = {"logits": logits + 1e-2, "probabilities": probabilities, "label": label}
    assert not check.judge_digits("p", "digits", [(off, want)]).passed
    wrong_label = {"logits": logits, "probabilities": probabilities, "label": np.array([[2]])}
    verdict = check.judge_digits("p", "digits", [(wrong_label, want)])
    assert not verdict.passed and verdict.argmax_equal is False


class FakeReference(check.Reference):
    """Deterministic 'embeddings' from the text itself, so no model is loaded."""

    def embeddings(self, texts: list[str]) -> np.ndarray:
        return np.array([[len(t), t.count(" ") + 1.0, 1.0] for t in texts])


def test_check_workload_posts_the_peer_format_and_judges_the_answers() -> None:
    reference = FakeReference()
    seen: list[tuple[str, bytes]] = []

    def infinity(url: str, body: bytes) -> tuple[int, bytes]:
        seen.append((url, body))
        texts = orjson.loads(body)["input"]
        rows = reference.embeddings(texts) * 3.0  # scaled: cosine is still 1
        data = [{"index": i, "embedding": row.tolist()} for i, row in enumerate(rows)]
        return 200, orjson.dumps({"data": data})

    result = check.check_workload("http://x", "infinity-onnx", "minilm-8", reference, post=infinity)
    assert result.passed and result.min_cosine == pytest.approx(1.0)
    assert result.requests == check.REQUESTS_CHECKED["minilm-8"]
    assert all(url == "http://x/embeddings" for url, _ in seen)

    def failing(url: str, body: bytes) -> tuple[int, bytes]:
        return 400, b'{"error": "unexpected shape"}'

    refused = check.check_workload("http://x", "pytriton", "minilm-1", reference, post=failing)
    assert not refused.passed and refused.detail.startswith("HTTP 400")

    def unreachable(url: str, body: bytes) -> tuple[int, bytes]:
        raise ConnectionRefusedError("refused")

    down = check.check_workload("http://x", "torchserve", "minilm-1", reference, post=unreachable)
    assert not down.passed and "HTTP 0" in down.detail


# ----------------------------------------------------------------------------- server commands
def test_server_commands_bind_the_bench_port_and_carry_the_batching_options() -> None:
    python = Path("/venv/bin/python")
    triton = servers.pytriton_server(python, "minilm", servers.TritonOptions(64, 500), cpus="1")
    assert triton.command[:2] == [str(python), str(PEERS_PACKAGE / "pytriton_server.py")]
    assert triton.command[triton.command.index("--port") + 1] == "{port}"
    assert triton.command[triton.command.index("--max-batch-size") + 1] == "64"
    assert triton.command[triton.command.index("--max-queue-delay-us") + 1] == "500"
    assert Path(triton.command[triton.command.index("--model-dir") + 1]).is_dir()
    assert triton.ready_path == "/v2/models/minilm/ready"
    assert triton.cpus == "1" and triton.env["HF_HUB_OFFLINE"] == "1"
    # Triton's gRPC port is the bench's to pick too: perf_analyzer drives it.
    assert triton.command[triton.command.index("--grpc-port") + 1] == str(triton.grpc_port)
    assert triton.grpc_address == f"127.0.0.1:{triton.grpc_port}"

    torchserve = servers.torchserve_server(python, "digits", servers.TorchServeOptions(8, 2, 2))
    assert "--model-dir" not in torchserve.command
    assert torchserve.ready_path == "/predictions/digits"
    tail = torchserve.command[torchserve.command.index("--batch-size") :]
    assert tail == ["--batch-size", "8", "--max-batch-delay-ms", "2", "--workers", "2"]
    assert torchserve.name == "torchserve-digits-8-2ms-w2"


def test_infinity_engines_get_their_own_model_folders(tmp_path: Path) -> None:
    python = Path("/venv/bin/python")
    onnx = servers.infinity_server(
        python, servers.InfinityOptions("optimum", 64), work_root=tmp_path
    )
    plain = servers.infinity_server(
        python, servers.InfinityOptions("torch", 32, bettertransformer=False), work_root=tmp_path
    )
    assert onnx.command[onnx.command.index("--work-dir") + 1] == str(tmp_path / "model-minilm-onnx")
    assert plain.command[plain.command.index("--work-dir") + 1] == str(
        tmp_path / "model-minilm-torch"
    )
    assert (
        "--no-bettertransformer" in plain.command and "--no-bettertransformer" not in onnx.command
    )
    assert onnx.ready_path == plain.ready_path == "/health"
    assert onnx.name.startswith("infinity-onnx-") and plain.name.startswith("infinity-torch-")


def test_peer_server_refuses_options_of_another_peer() -> None:
    python = Path("/venv/bin/python")
    with pytest.raises(ValueError):
        servers.peer_server("pytriton", python, "minilm", servers.TorchServeOptions())
    with pytest.raises(ValueError):
        servers.peer_server("infinity-torch", python, "minilm", servers.InfinityOptions("optimum"))
    with pytest.raises(ValueError):
        servers.peer_server("infinity-torch", python, "digits", servers.InfinityOptions())
    for system, sweep in servers.SWEEPS.items():
        for options in sweep:
            for model in servers.MODELS_OF_SYSTEM[system]:
                assert servers.peer_server(system, python, model, options).command


def test_infinity_command_pools_by_mean_from_inside_the_folder() -> None:
    command = infinity_server.infinity_command(
        Path("/v/bin/infinity_emb"), engine="optimum", port=9, batch_size=16, served_name="minilm"
    )
    pairs = dict(zip(command[2::2], command[3::2], strict=False))
    assert command[1] == "v2"
    assert pairs["--model-id"] == "." and pairs["--pooling-method"] == "mean"
    assert pairs["--host"] == "127.0.0.1" and pairs["--engine"] == "optimum"


def test_infinity_folder_links_every_model_file(tmp_path: Path) -> None:
    source = tmp_path / "model"
    (source / "1_Pooling").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    work = tmp_path / "work"
    infinity_server.prepare_folder(source, work)
    infinity_server.prepare_folder(source, work)  # idempotent
    assert sorted(p.name for p in work.iterdir()) == ["1_Pooling", "config.json"]
    assert all(p.is_symlink() for p in work.iterdir())


def test_torchserve_config_binds_loopback_with_the_batching_asked() -> None:
    text = torchserve_server.config_properties(
        model="minilm",
        port=1,
        management_port=2,
        metrics_port=3,
        worker_port=4,
        model_store=Path("/store"),
        workers=2,
        batch_size=16,
        max_batch_delay_ms=7,
    )
    settings = dict(line.split("=", 1) for line in text.splitlines())
    assert settings["inference_address"] == "http://127.0.0.1:1"
    assert settings["management_address"] == "http://127.0.0.1:2"
    assert settings["metrics_address"] == "http://127.0.0.1:3"
    assert settings["disable_token_authorization"] == "true"
    model = json.loads(settings["models"])["minilm"]["1.0"]
    assert (model["batchSize"], model["maxBatchDelay"]) == (16, 7)
    assert (model["minWorkers"], model["maxWorkers"]) == (2, 2)


def test_torchserve_handler_answers_each_request_of_a_batch(tmp_path: Path) -> None:
    """The handler as TorchServe drives it, on the real digits CNN (a few ms)."""
    shutil.copy(PEERS_PACKAGE / "peer_models.py", tmp_path / "peer_models.py")
    digits_dir = PEERS_PACKAGE.parents[1] / "models" / "digits"
    settings = {"model": "digits", "model_dir": str(digits_dir)}
    (tmp_path / "peer_model.json").write_text(json.dumps(settings))
    handler_module = _import(PEERS_PACKAGE / "torchserve_handler.py")
    statuses: dict[int, int] = {}
    context = SimpleNamespace(
        system_properties={"model_dir": str(tmp_path)},
        set_response_content_type=lambda idx, kind: None,
        set_response_status=lambda code, phrase, idx: statuses.__setitem__(idx, code),
    )
    images = make("digits", 3).bodies
    two = orjson.loads(images[1])
    two["inputs"][0]["shape"] = [2, 1, 8, 8]
    two["inputs"][0]["data"] = (
        two["inputs"][0]["data"] + orjson.loads(images[2])["inputs"][0]["data"]
    )
    batch = [
        {"body": orjson.loads(images[0])},
        {"body": b'{"nothing": 1}'},
        {"body": orjson.dumps(two)},
        {"body": b""},
    ]
    answers = handler_module.handle(batch, context)
    assert statuses == {1: 400}
    first, bad, pair, probe = answers
    assert protocol.answer_outputs(first)["logits"].shape == (1, 10)
    assert protocol.answer_outputs(pair)["label"].shape == (2, 1)
    assert b"error" in bad and json.loads(probe) == {"ready": True}


def _import(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_texts_come_back_as_str_from_bytes_or_json() -> None:
    assert texts_of(np.array([[b"a b"], [b"\xc3\xa9"]], dtype=object)) == ["a b", "é"]
    assert texts_of(["x", "y"]) == ["x", "y"]


# ----------------------------------------------------------------------------- environments
def test_requirements_pin_every_package_and_torch_first() -> None:
    for spec in envs.SPECS.values():
        lines = envs.requirement_lines(spec.requirements)
        # The constrained venvs take this checkout's CPU torch; the others their own pin.
        assert lines[0] == "torch==2.13.0" or not spec.constrained, spec.name
        assert lines[0].startswith("torch=="), spec.name
        assert all("==" in line for line in lines), spec.name


def test_preflight_names_what_is_missing() -> None:
    torchserve = envs.SPECS["torchserve"]
    reason = envs.preflight_reason(torchserve, which=lambda name: None)
    assert reason is not None and "java" in reason
    assert envs.preflight_reason(torchserve, which=lambda name: "/usr/bin/java") is None
    triton = envs.SPECS["pytriton"]
    old = envs.preflight_reason(triton, glibc=lambda: (2, 31))
    assert old is not None and "2.35" in old and "2.31" in old
    assert "not glibc" in (envs.preflight_reason(triton, glibc=lambda: None) or "")
    assert envs.preflight_reason(triton, glibc=lambda: (2, 36)) is None


class FakePip:
    """Records commands; creates the venv's python like ``python -m venv`` would."""

    def __init__(self, fail_on: str | None = None, timeout_on: str | None = None) -> None:
        self.commands: list[list[str]] = []
        self.fail_on = fail_on
        self.timeout_on = timeout_on

    def __call__(self, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.commands.append(command)
        joined = " ".join(command)
        if self.timeout_on and self.timeout_on in joined:
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        if command[1:3] == ["-m", "venv"]:
            python = Path(command[3]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.touch()
        if self.fail_on and self.fail_on in joined:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution\n")
        return subprocess.CompletedProcess(command, 0, "ok\n", "")


def _env(tmp_path: Path, runner: FakePip, peer: str = "infinity") -> envs.PeerEnv:
    return envs.ensure_env(
        peer,
        root=tmp_path,
        base_python="/usr/bin/python3",
        runner=runner,
        which=lambda name: "/usr/bin/java",
        glibc=lambda: (2, 36),
    )


def test_a_built_env_is_stamped_and_skipped_the_second_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requirements = tmp_path / "requirements"
    requirements.mkdir()
    (requirements / "infinity.txt").write_text("# pins\ntorch==2.13.0\ninfinity-emb==0.0.78\n")
    monkeypatch.setattr(envs, "REQUIREMENTS_DIR", requirements)
    first = FakePip()
    built = _env(tmp_path, first)
    assert built.ok and built.installed_now
    assert built.python == tmp_path / "infinity" / "venv" / "bin" / "python"
    steps = [" ".join(c[1:5]) for c in first.commands]
    assert steps[0].startswith("-m venv")
    assert first.commands[1][-1] == "torch==2.13.0"  # torch alone, before the rest
    assert "-r" in first.commands[2]
    assert first.commands[3][-3:] == ["uninstall", "-y", "torchvision"]
    assert first.commands[4][1] == "-c"  # the import check
    again = FakePip()
    skipped = _env(tmp_path, again)
    assert skipped.ok and not skipped.installed_now and again.commands == []
    (requirements / "infinity.txt").write_text("torch==2.13.0\ninfinity-emb==0.0.79\n")
    rebuilt = FakePip()
    assert _env(tmp_path, rebuilt).installed_now and rebuilt.commands


def test_a_failed_install_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    failed = _env(tmp_path, FakePip(fail_on=" -r "), peer="pytriton")
    assert not failed.ok and failed.python is None
    assert failed.reason is not None
    assert "pip install failed (exit 1): ERROR: No matching distribution" in failed.reason
    assert not (tmp_path / "pytriton" / "venv" / envs.STAMP_NAME).exists()
    assert "No matching distribution" in (tmp_path / "pytriton" / "install.log").read_text()
    slow = _env(tmp_path, FakePip(timeout_on="torch=="), peer="pytriton")
    assert slow.reason is not None and "timed out" in slow.reason
    assert "unknown peer" in (envs.ensure_env("nothing").reason or "")


def test_no_java_stops_torchserve_before_any_install(tmp_path: Path) -> None:
    runner = FakePip()
    env = envs.ensure_env("torchserve", root=tmp_path, runner=runner, which=lambda name: None)
    assert not env.ok and "java" in (env.reason or "") and runner.commands == []
