"""Metrics shared by several processes through files: every update lands in this process's own
file, read by any process that renders /metrics, without asking the kernel for the process id on
each update; a forked child writes a file of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, os, sys

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from nograd.observability.metrics import Metrics

metrics = Metrics(multiprocess_dir=os.environ["PROMETHEUS_MULTIPROC_DIR"])
asked = []
sys.setprofile(lambda frame, event, arg: asked.append(1) if arg is os.getpid else None)
for _ in range(3):
    metrics.request_done("digits", "v2", 200, 0.01)
metrics.inflight.inc()
sys.setprofile(None)
assert not asked, f"asked for the pid {len(asked)} times"
child = os.fork()
if child == 0:
    metrics.request_done("digits", "v2", 200, 0.01)
    os._exit(0)
os.waitpid(child, 0)
registry = CollectorRegistry()
MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
text = generate_latest(registry).decode()
files = sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
print(json.dumps({"text": text, "files": files, "pid": os.getpid(), "child": child}))
"""


def test_updates_land_in_each_processs_file_without_asking_for_its_pid(tmp_path: Path) -> None:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The parent's three answers and the forked child's one, each from its own file.
    assert 'nograd_requests_total{code="200",model="digits",protocol="v2"} 4.0' in result["text"]
    assert any(name.endswith(f"_{result['pid']}.db") for name in result["files"])
    assert any(name.endswith(f"_{result['child']}.db") for name in result["files"])
