"""deploy/k8s: core objects pass the Kubernetes schema; KServe and adapter objects hang together.

kubernetes-validate checks Deployment, Service, HPA and ConfigMap against the API's OpenAPI schema
(strict: an unknown or misspelt field fails). It has no schemas for CRDs (KServe, PodMonitor), so
those are checked for the structure KServe needs, and their containers are validated as a Pod.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nograd.fleet.balancer import check_config
from nograd.settings import Settings
from nograd.supervisor.plan import auto_fronts, auto_workers
from tests.prometheus_tools import ROOT, exported_metric_names, promql_metric_names

K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes we claim (autoscaling/v2 is GA since 1.23; 1.29 is still widely run) and
# the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
CORE_KINDS = {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
DEFAULT_DRAIN_TIMEOUT_S = float(Settings.model_fields["drain_timeout_s"].default)
"""NOGRAD_DRAIN_TIMEOUT_S's default, which applies where a manifest does not set it."""


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _all_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, doc)
        for path in sorted(K8S.rglob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in _documents(path)
    ]


def _one(kind: str, path: Path) -> dict[str, Any]:
    (doc,) = [d for d in _documents(path) if d["kind"] == kind]
    return doc


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


DEPLOYMENTS = [K8S / "deployment.yaml", K8S / "deployment-gpu.yaml"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_objects_pass_the_schema(version: str) -> None:
    checked = set()
    for path, doc in _all_objects():
        if doc["kind"] not in CORE_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)} {doc['kind']}: {exc.message} at {exc.path}")
        checked.add(doc["kind"])
    assert checked == CORE_KINDS


def test_kustomization_lists_existing_core_files() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert {"deployment.yaml", "service.yaml", "hpa.yaml"} <= set(resources)
    for name in resources:
        assert (K8S / name).is_file(), name


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_deployment_probes_and_drain(path: Path) -> None:
    deployment = _one("Deployment", path)
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001}

    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    startup = container["startupProbe"]
    # Model loads and memory profiling are slow: the startup probe must allow minutes.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120

    # SIGKILL comes after terminationGracePeriodSeconds, counted from the start of preStop: it
    # must cover the preStop sleep plus the whole drain.
    env = _env(container)
    drain = float(env.get("NOGRAD_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S))
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain

    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_deployment_env_names_real_settings(path: Path) -> None:
    """Every NOGRAD_* variable is a Settings field: a typo would be silently ignored otherwise."""
    (container,) = _one("Deployment", path)["spec"]["template"]["spec"]["containers"]
    known = {f"NOGRAD_{name.upper()}" for name in Settings.model_fields}
    unknown = set(_env(container)) - known
    assert not unknown, f"not Settings fields: {sorted(unknown)}"
    assert _env(container)["NOGRAD_PORT"] == "8000"


SERVERS = [
    (K8S / "deployment.yaml", "Deployment"),
    (K8S / "deployment-gpu.yaml", "Deployment"),
    (K8S / "fleet" / "replicas.yaml", "StatefulSet"),
    (K8S / "kserve" / "servingruntime.yaml", "ServingRuntime"),
]
"""Every shipped object that runs nograd, and its kind."""


def _server_container(path: Path, kind: str) -> dict[str, Any]:
    doc = _one(kind, path)
    spec = doc["spec"] if kind == "ServingRuntime" else doc["spec"]["template"]["spec"]
    container: dict[str, Any]
    (container,) = spec["containers"]
    return container


def _setting(env: dict[str, Any], name: str) -> Any:
    """A setting as the container sets it, else its default."""
    return env.get(f"NOGRAD_{name.upper()}", str(Settings.model_fields[name].default))


@pytest.mark.parametrize(("path", "kind"), SERVERS, ids=lambda p: getattr(p, "name", None))
def test_workers_share_the_cpu_quota(path: Path, kind: str) -> None:
    """The processes that hold the models take their torch threads from the container's CPU
    quota: a fixed NOGRAD_TORCH_THREADS would give each of several workers that many and
    oversubscribe the limit. One such process per GPU: more would hold several copies of the
    weights on one device. With fronts (the default on 2+ cores) one engine holds them all."""
    container = _server_container(path, kind)
    env = _env(container)
    workers, fronts = _setting(env, "workers"), _setting(env, "fronts")
    gpu = "nvidia.com/gpu" in container["resources"].get("limits", {})
    limit = str(container["resources"]["limits"]["cpu"])  # "2", or millicores: "1500m"
    cpus = float(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)
    # auto plans from the same cgroup quota the pod gets (rounded up, as usable_cores does).
    cores = math.ceil(cpus)
    threads = env.get("NOGRAD_TORCH_THREADS")
    fixed = int(threads) if isinstance(threads, str) else None
    if fronts == "auto":
        # Fronts only beside workers = auto, and only with HTTP on (nograd.supervisor.plan).
        planned = workers == "auto" and _setting(env, "port") != "0"
        on_demand = _setting(env, "model_control") == "on_demand"
        fronts = auto_fronts(cores, gpu, on_demand)[0] if planned else 0
    if int(fronts):
        assert workers in {"auto", "1"}, "the server refuses fronts beside several workers"
        holding = 1  # the engine
    else:
        holding = auto_workers(cores, gpu, fixed)[0] if workers == "auto" else int(workers)
    if gpu:
        assert holding == 1
    else:
        assert 1 <= holding <= cpus
    if holding > 1:
        assert "NOGRAD_TORCH_THREADS" not in env


def test_gpu_variant_requests_a_gpu() -> None:
    spec = _one("Deployment", K8S / "deployment-gpu.yaml")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def test_service_targets_the_deployment() -> None:
    service = _one("Service", K8S / "service.yaml")
    deployment = _one("Deployment", K8S / "deployment.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {port["name"]: (port["port"], port["targetPort"]) for port in service["spec"]["ports"]}
    assert ports == {"http": (8000, "http"), "grpc": (8001, "grpc")}


def test_hpa_scales_on_a_served_custom_metric() -> None:
    """The HPA's per-pod metric is one the adapter serves, from a metric nograd exports."""
    hpa = _one("HorizontalPodAutoscaler", K8S / "hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "nograd")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name in {"nograd_queue_depth", "nograd_inflight_requests"}

    adapter = yaml.safe_load(
        _one("ConfigMap", K8S / "prometheus-adapter.yaml")["data"]["config.yaml"]
    )
    served = {rule["name"]["as"]: rule for rule in adapter["rules"]}
    assert name in served, f"prometheus-adapter serves no {name}"
    exported = exported_metric_names()
    for rule in adapter["rules"]:
        series = promql_metric_names(rule["seriesQuery"])
        assert series <= exported, f"adapter rule reads {series - exported}"
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod"
        assert overrides["namespace"]["resource"] == "namespace"
        assert "<<.Series>>" in rule["metricsQuery"]
        assert "<<.GroupBy>>" in rule["metricsQuery"]


def test_kserve_serving_runtime() -> None:
    runtime = _one("ServingRuntime", K8S / "kserve" / "servingruntime.yaml")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = runtime["spec"]
    assert "v2" in spec["protocolVersions"]
    assert spec["supportedModelFormats"]
    (container,) = spec["containers"]
    # KServe finds the serving container by this name.
    assert container["name"] == "kserve-container"
    assert container["image"].startswith("nograd:")
    assert [port["containerPort"] for port in container["ports"]] == [8000]
    env = _env(container)
    # KServe's storage initializer puts the storageUri's contents in /mnt/models.
    assert env["NOGRAD_MODEL_REPOSITORY"] == "/mnt/models"
    assert env["NOGRAD_PORT"] == "8000"
    known = {f"NOGRAD_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= known, f"not Settings fields: {sorted(set(env) - known)}"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kserve_container_is_a_valid_container(version: str) -> None:
    """No schema for the CRD here, but its container is a core/v1 Container: validate as a Pod."""
    runtime = _one("ServingRuntime", K8S / "kserve" / "servingruntime.yaml")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "servingruntime-container-check"},
        "spec": {"containers": runtime["spec"]["containers"]},
    }
    kubernetes_validate.validate(pod, version, strict=True)


def test_kserve_inference_service_uses_the_runtime() -> None:
    runtime = _one("ServingRuntime", K8S / "kserve" / "servingruntime.yaml")
    isvc = _one("InferenceService", K8S / "kserve" / "inferenceservice.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["metadata"]["name"]
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["protocolVersion"] == "v2"
    assert model["storageUri"]
    assert predictor["scaleMetric"] == "concurrency"
    # Knative uses the request timeout as the pod's grace period: it must cover the drain.
    assert predictor["timeout"] > DEFAULT_DRAIN_TIMEOUT_S


def test_podmonitor_scrapes_the_pods() -> None:
    monitor = _one("PodMonitor", K8S / "podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    deployment = _one("Deployment", K8S / "deployment.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    # The job label comes from the pod label: "nograd", which the alert rules' up{} matches.
    assert pod_labels[monitor["spec"]["jobLabel"]] == "nograd"


# --- deploy/k8s/fleet: replicas behind HAProxy, the balancer's config the one-machine fleet's ----

FLEET = K8S / "fleet"
FLEET_CONFIG = ROOT / "deploy" / "fleet" / "haproxy.cfg"


def _fleet_balancer() -> tuple[dict[str, Any], dict[str, Any]]:
    """The balancer's Deployment and its container."""
    deployment = _one("Deployment", FLEET / "balancer.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def _fleet_env(container: dict[str, Any]) -> dict[str, str]:
    """The balancer's variables as the kubelet expands them ($(VAR) of earlier ones)."""
    env: dict[str, str] = {"POD_NAMESPACE": "default"}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
    return env


def test_fleet_balancer_runs_the_one_machine_config() -> None:
    configmap = _one("ConfigMap", FLEET / "balancer.yaml")
    assert configmap["data"]["haproxy.cfg"] == FLEET_CONFIG.read_text(), (
        "run python scripts/sync_fleet_configmap.py"
    )
    deployment, container = _fleet_balancer()
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert volumes[config_volume]["configMap"]["name"] == configmap["metadata"]["name"]
    assert f"{mounts[config_volume]}/haproxy.cfg" in container["args"]


def test_fleet_balancer_sets_every_variable_of_the_config(tmp_path: Path) -> None:
    _, container = _fleet_balancer()
    env = _fleet_env(container)
    used = set(re.findall(r"\$\{(NOGRAD_FLEET_\w+)\}", FLEET_CONFIG.read_text()))
    assert used <= env.keys(), used - env.keys()
    # haproxy -c with exactly these variables, where HAProxy is installed.
    if shutil.which("haproxy"):
        check_config(FLEET_CONFIG, {**env, "NOGRAD_FLEET_SOCKET": str(tmp_path / "api.sock")})


def test_fleet_balancer_reads_replicas_from_the_headless_service() -> None:
    service = _one("Service", FLEET / "replicas.yaml")
    replicas = _one("StatefulSet", FLEET / "replicas.yaml")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"]["publishNotReadyAddresses"]
    assert replicas["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    _, container = _fleet_balancer()
    env = _fleet_env(container)
    assert env["NOGRAD_FLEET_DNS"] == f"{service['metadata']['name']}.default.svc.cluster.local"
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    assert ports == {
        "http": int(env["NOGRAD_FLEET_HTTP_PORT"]),
        "grpc": int(env["NOGRAD_FLEET_GRPC_PORT"]),
    }
    assert int(env["NOGRAD_FLEET_SLOTS"]) >= replicas["spec"]["replicas"]
    front = _one("Service", FLEET / "balancer.yaml")
    balancer_labels = _fleet_balancer()[0]["spec"]["template"]["metadata"]["labels"]
    assert front["spec"]["selector"].items() <= balancer_labels.items()
    assert not front["spec"]["selector"].items() <= pod_labels.items()


def _seconds(config: str, key: str) -> float:
    (value,) = re.findall(rf"^\s*{key}\s+(\d+)s$", config, re.MULTILINE)
    return float(value)


def test_fleet_replica_leaves_the_ring_before_it_stops() -> None:
    """A terminating pod leaves DNS; the balancer drops it within its resolvers' hold times,
    which the preStop sleep covers; nograd's drain then fits before SIGKILL."""
    replicas = _one("StatefulSet", FLEET / "replicas.yaml")
    pod = replicas["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    config = FLEET_CONFIG.read_text()
    leaves_ring_s = (
        _seconds(config, "timeout resolve")
        + _seconds(config, "hold valid")
        + _seconds(config, "hold obsolete")
    )
    assert pre_stop > leaves_ring_s
    env = _env(container)
    drain = float(env.get("NOGRAD_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S))
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain


def test_fleet_replicas_keep_models_by_bytes() -> None:
    (container,) = _one("StatefulSet", FLEET / "replicas.yaml")["spec"]["template"]["spec"][
        "containers"
    ]
    env = _env(container)
    known = {f"NOGRAD_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= known, f"not Settings fields: {sorted(set(env) - known)}"
    assert env["NOGRAD_MODEL_CONTROL"] == "on_demand"
    assert env["NOGRAD_MEMORY_LIMIT_BYTES"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": int(env["NOGRAD_PORT"]), "grpc": int(env["NOGRAD_GRPC_PORT"])}


def test_fleet_kustomization_lists_its_files() -> None:
    kustomization = yaml.safe_load((FLEET / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in FLEET.glob("*.yaml")} - {
        "kustomization.yaml"
    }
