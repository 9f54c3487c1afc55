"""The archives phase's pure parts: the answer comparison that gates its numbers, the report's
per-round arithmetic, TorchServe's store configuration, and the PNG bodies wrk sends."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from bench import loadgen, workloads
from bench.peers.torchserve_store import StorePorts, store_config, torchserve_store_server
from bench.phases.archives import archive_concurrencies, compare_answers, same_answer
from bench.report.archives import archive_rows, archives_section


def test_answers_agree_as_json_whatever_the_layout() -> None:
    assert same_answer((200, b"7"), (200, b"7\n"))
    assert same_answer((200, b'{"a": [1, 2]}'), (200, b'{\n  "a": [\n    1,\n    2\n  ]\n}'))
    assert not same_answer((200, b"7"), (200, b"1"))
    assert not same_answer((503, b"7"), (200, b"7"))
    assert same_answer((200, b"\x89PNG"), (200, b"\x89PNG"))
    assert not same_answer((200, b"\x89PNG"), (200, b"\x89PNH"))


def test_the_check_counts_agreements_and_shows_the_first_difference() -> None:
    ours = [(200, b"1"), (200, b"2"), (200, b"3")]
    theirs = [(200, b"1"), (200, b"9"), (500, b"oops")]
    check = compare_answers(ours, theirs)
    assert check["requests"] == 3
    assert check["same"] == 1
    assert check["first_difference"] == {
        "index": 1,
        "nograd": [200, "2"],
        "torchserve": [200, "9"],
    }
    assert compare_answers(ours, ours)["first_difference"] is None
    with pytest.raises(ValueError):
        compare_answers(ours, theirs[:2])


def test_concurrencies_are_the_headline_and_the_archives_batch() -> None:
    assert archive_concurrencies(32, 8) == [32, 8]
    assert archive_concurrencies(8, 8) == [8]


def _run(system: str, concurrency: int, round_: int, rps: float, p99: float) -> dict[str, Any]:
    return {
        "system": system,
        "workload": "mnist-png",
        "concurrency": concurrency,
        "round": round_,
        "rps": rps,
        "p50_ms": p99 / 2,
        "p99_ms": p99,
        "errors": 0,
    }


def test_rows_take_medians_and_per_round_ratios() -> None:
    runs = [
        _run("nograd", 32, 1, 300.0, 100.0),
        _run("torchserve", 32, 1, 100.0, 400.0),  # round 1: 3.0x, p99 0.25x
        _run("nograd", 32, 2, 150.0, 200.0),
        _run("torchserve", 32, 2, 100.0, 400.0),  # round 2: 1.5x, p99 0.5x
        _run("nograd", 32, 3, 200.0, 100.0),
        _run("torchserve", 32, 3, 50.0, 200.0),  # round 3: 4.0x, p99 0.5x
        _run("nograd-workers-1", 32, 3, 100.0, 100.0),  # one round only: 2.0x
        _run("nograd", 8, 1, 90.0, 20.0),  # no TorchServe run in this round: not paired
    ]
    rows = archive_rows({"archives": {"runs": runs}})
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (32, "nograd as shipped (`make run`'s processes)", 3),
        (32, "nograd, one process", 1),
        (32, "TorchServe", 3),
    ]
    _, _, _, rps, p50, p99, ratio, p99_ratio, failed, foreign = rows[0]
    assert (rps, p50, p99) == (200.0, 50.0, 100.0)
    # the median of the per-round ratios (3.0, 1.5, 4.0), not the ratio of the medians (2.0)
    assert (ratio, p99_ratio) == ("3.00×", "0.50×")
    assert (failed, foreign) == (0, 0.0)
    assert rows[1][6] == "2.00×"
    assert rows[2][3:8] == (100.0, 200.0, 400.0, "1.00×", "1.00×")


def test_section_says_why_torchserve_was_not_measured() -> None:
    results = {"archives": {"archive": "mnist.mar", "refused": "torchserve did not start"}}
    text = "\n".join(archives_section(results, "2 cores"))
    assert "Not measured: torchserve did not start" in text
    assert archives_section({}, "2 cores") == []


def test_torchserve_serves_the_whole_store_on_its_own_ports(tmp_path: Path) -> None:
    ports = StorePorts(inference=1234)
    config = store_config(tmp_path, ports)
    assert "inference_address=http://127.0.0.1:1234\n" in config
    assert f"model_store={tmp_path}\n" in config
    assert "load_models=all\n" in config
    listeners = [ports.management, ports.metrics, ports.worker, ports.grpc_inference]
    assert len({1234, *listeners, ports.grpc_management}) == 6
    python = tmp_path / "venv" / "bin" / "python"
    server = torchserve_store_server(python, tmp_path / "store", tmp_path / "ts")
    written = (tmp_path / "ts" / "config.properties").read_text()
    assert f"inference_address=http://127.0.0.1:{server.port}\n" in written
    assert server.command[0] == str(python.parent / "torchserve")
    assert server.env["TMPDIR"] == str(tmp_path / "ts")
    assert server.env["PATH"].startswith(str(python.parent))


def test_the_archive_workload_puts_pngs_written_hex_encoded(tmp_path: Path) -> None:
    wl = workloads.make("mnist-png")
    assert (wl.method, wl.path, wl.binary) == ("PUT", "/predictions/mnist", True)
    assert len(wl.bodies) == workloads.MNIST_PNG_BODIES
    assert all(body.startswith(b"\x89PNG\r\n\x1a\n") for body in wl.bodies)
    assert len(set(wl.bodies)) == len(wl.bodies)
    assert wl.bodies == workloads.make("mnist-png").bodies  # deterministic
    path = wl.write_bodies(tmp_path)
    lines = path.read_bytes().split(b"\n")
    assert [bytes.fromhex(line.decode()) for line in lines if line] == list(wl.bodies)


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_wrk_sends_the_decoded_binary_bodies_with_the_method_asked(tmp_path: Path) -> None:
    seen: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.command, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "1")
            self.end_headers()
            self.wfile.write(b"7")

        def log_message(self, *args: object) -> None:
            pass

    bodies = (b"\x89PNG\r\n\x1a\n\x00line\nbreak", b"\xff\x00\n\n")
    wl = workloads.Workload(
        "raw", "m", 1, bodies, "raw", method="PUT", content_type="image/png", route="/p"
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = loadgen.run_closed(
            f"http://127.0.0.1:{server.server_address[1]}/p",
            wl.write_bodies(tmp_path),
            system="test",
            workload="raw",
            samples_per_request=1,
            connections=1,
            duration_s=1.0,
            cpus=None,
            method=wl.method,
            content_type=wl.content_type,
            hex_bodies=wl.binary,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.requests > 0 and result.errors == 0
    assert {body for _, _, body in seen} == set(bodies)
    assert {(method, kind) for method, kind, _ in seen} == {("PUT", "image/png")}
    assert os.environ.get("NOGRAD_BENCH_HEX") is None  # set for wrk only
