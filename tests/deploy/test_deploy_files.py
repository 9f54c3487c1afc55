"""The container and compose files agree with each other and with the app's routes.

Static checks only (no container engine needed): docker-compose.yml, the Prometheus config and the
Dockerfile are parsed and cross-checked. `make container-test` builds and runs the image.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DOCKERIGNORE = ROOT / ".dockerignore"
READY_PATH = "/v2/health/ready"
METRICS_PATH = "/metrics"


# --- Dockerfile parsing -------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        keyword, _, args = pending.strip().partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (each starts with FROM)."""
    result: list[list[tuple[str, str]]] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, args))
    return result


def env_pairs(args: str) -> dict[str, str]:
    """ENV in the KEY=VALUE form (several per instruction)."""
    pairs: dict[str, str] = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        assert sep, f"ENV {args!r}: use the KEY=VALUE form"
        pairs[key] = value
    return pairs


@pytest.fixture(scope="module")
def final_stage() -> list[tuple[str, str]]:
    return stages(dockerfile_instructions(DOCKERFILE.read_text()))[-1]


def final(final_stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for kw, args in final_stage if kw == keyword]


# --- compose / prometheus -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(PROMETHEUS.read_text())
    return document


def container_ports(service: dict[str, Any]) -> set[int]:
    """Container-side ports of a compose service's `ports` (short and long syntax)."""
    ports: set[int] = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
            continue
        spec = str(entry).split("/")[0]  # drop /tcp
        ports.add(int(spec.rsplit(":", 1)[-1]))
    return ports


def healthcheck_text(test: Any) -> str:
    if isinstance(test, list):
        assert test and test[0] in {"CMD", "CMD-SHELL"}, test
        return " ".join(str(word) for word in test[1:])
    return str(test)


def nograd_job(prometheus: dict[str, Any]) -> dict[str, Any]:
    jobs = [job for job in prometheus["scrape_configs"] if job["job_name"] == "nograd"]
    assert len(jobs) == 1, "exactly one scrape job named nograd"
    return jobs[0]


# --- tests --------------------------------------------------------------------------------------


def test_dockerfile_has_ready_healthcheck(final_stage: list[tuple[str, str]]) -> None:
    healthchecks = final(final_stage, "HEALTHCHECK")
    assert len(healthchecks) == 1, "the runtime stage needs exactly one HEALTHCHECK"
    check = healthchecks[0]
    assert READY_PATH in check
    # slim images have no curl: the check uses Python's urllib
    assert "urllib" in check and "curl" not in check and "wget" not in check
    # exec form, so it runs without a shell
    cmd = check.split("CMD", 1)[1].strip()
    assert json.loads(cmd)[0].endswith("python"), cmd


def test_dockerfile_runs_as_non_root(final_stage: list[tuple[str, str]]) -> None:
    users = final(final_stage, "USER")
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0", ""}, users[-1]


def test_dockerfile_unbuffered_python(final_stage: list[tuple[str, str]]) -> None:
    env: dict[str, str] = {}
    for args in final(final_stage, "ENV"):
        env.update(env_pairs(args))
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert env.get("NOGRAD_MODEL_REPOSITORY", "").startswith("/"), "model repo path is absolute"


def test_dockerfile_starts_nograd(final_stage: list[tuple[str, str]]) -> None:
    commands = final(final_stage, "CMD") + final(final_stage, "ENTRYPOINT")
    assert commands, "no CMD or ENTRYPOINT"
    argv = [word for args in commands for word in json.loads(args)]  # exec form
    assert any(Path(word).name == "nograd" for word in argv), argv


def test_dockerfile_pins_cpu_torch() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S*python:3\.11-slim", text, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "-c constraints.txt" in text, "installs go through the constraints file"
    assert "--no-cache-dir" in text


def test_compose_port_matches_expose(
    final_stage: list[tuple[str, str]], compose: dict[str, Any]
) -> None:
    exposed = {
        int(port.split("/")[0]) for args in final(final_stage, "EXPOSE") for port in args.split()
    }
    assert exposed == {8000, 8001}, "HTTP and gRPC"
    service = compose["services"]["nograd"]
    assert container_ports(service) == exposed
    environment = service.get("environment", {})
    assert int(environment.get("NOGRAD_PORT", 8000)) in exposed
    assert int(environment.get("NOGRAD_GRPC_PORT", 8001)) in exposed


def test_compose_healthcheck_hits_ready(
    final_stage: list[tuple[str, str]], compose: dict[str, Any]
) -> None:
    test = compose["services"]["nograd"]["healthcheck"]["test"]
    text = healthcheck_text(test)
    assert READY_PATH in text
    assert "$" not in text or "$$" in text, "compose would interpolate a bare $"
    # the same command as the image's HEALTHCHECK
    image_cmd = json.loads(final(final_stage, "HEALTHCHECK")[0].split("CMD", 1)[1].strip())
    assert test[0] == "CMD" and test[1:] == image_cmd


def test_compose_builds_the_dockerfile(compose: dict[str, Any]) -> None:
    service = compose["services"]["nograd"]
    build = service["build"]
    context = build if isinstance(build, str) else build.get("context", ".")
    assert (COMPOSE.parent / context / "Dockerfile").is_file()
    assert service["image"] == "nograd:latest"


def test_prometheus_scrapes_nograd_metrics(
    compose: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    job = nograd_job(prometheus)
    assert job.get("metrics_path", "/metrics") == METRICS_PATH
    assert job.get("scrape_interval") == "5s"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    service_ports = container_ports(compose["services"]["nograd"])
    assert targets, "no targets"
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host == "nograd", f"{target}: scrape the compose service by its name"
        assert int(port) in service_ports, f"{target}: not the service's container port"


def test_compose_mounts_prometheus_config(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    assert "prom/prometheus" in service["image"]
    config = "/etc/prometheus/prometheus.yml"
    for arg in service.get("command", []):
        if str(arg).startswith("--config.file="):
            config = str(arg).split("=", 1)[1]
    mounted = False
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        source_path = (COMPOSE.parent / source).resolve()
        inside = Path(config).relative_to(target) if Path(config).is_relative_to(target) else None
        if inside is not None and (source_path / inside).resolve() == PROMETHEUS.resolve():
            mounted = True  # the file itself, or a folder holding it
    assert mounted, f"{PROMETHEUS.relative_to(ROOT)} is not mounted at {config}"


def test_dockerignore_keeps_context_small() -> None:
    patterns = {line.strip().rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()}
    for name in (".git", ".venv", "tests", "bench", ".container", "**/__pycache__"):
        assert name in patterns, f".dockerignore misses {name}"
    for needed in ("nograd", "models", "pyproject.toml", "constraints.txt", "wheels"):
        assert needed not in patterns, f".dockerignore drops {needed}, which the build needs"
