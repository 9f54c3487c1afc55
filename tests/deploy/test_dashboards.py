"""Every PromQL query in the Grafana dashboard and the alert rules names a metric nograd exports.

The exported set is read from ``nograd.observability.metrics.Metrics()``'s registry, never listed
by hand, so a
renamed metric breaks this test instead of silently emptying a panel or disarming an alert.
Syntax is checked by the real PromQL parser: every dashboard query goes through
``promtool check rules`` as a recording rule.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prometheus_tools import (
    GRAFANA_DIR,
    GRAFANA_VARIABLES,
    PROMETHEUS_DIR,
    PROMETHEUS_SERIES,
    ROOT,
    alerting_rules,
    exported_metric_names,
    promql_metric_names,
    promtool,
)

DASHBOARDS = sorted((GRAFANA_DIR / "dashboards").glob("*.json"))
COMPOSE = ROOT / "docker-compose.yml"

_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)")


def _dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) for each panel target, nested rows included."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard["panels"])


def _variable_metrics(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        for metric in _LABEL_VALUES.findall(text):
            yield f"variable {variable['name']!r}", metric


def _load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_metric_names()


@pytest.fixture(scope="module", params=DASHBOARDS, ids=lambda path: path.name)
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _load(request.param)


def test_extractor_on_known_expressions() -> None:
    cases = {
        'histogram_quantile(0.99, sum by (model, le) (rate(nograd_request_duration_seconds_bucket{model=~"$model"}[$__rate_interval])))': {  # noqa: E501
            "nograd_request_duration_seconds_bucket"
        },
        'up{job=~"nograd.*"} == 0': {"up"},
        "sum by (instance) (rate(a_total[5m] offset 1h)) / on (instance) group_left () b > 1e-9": {
            "a_total",
            "b",
        },
        'max_over_time(x{reason="rate(y)"}[2m:30s]) and bool z unless w': {"x", "z", "w"},
        "vector(1) + time()": set(),
    }
    for expr, names in cases.items():
        assert promql_metric_names(expr) == names, expr


def test_exported_names_come_from_the_registry(exported: set[str]) -> None:
    # Spot checks that the suffix logic is right; the set itself is never written by hand.
    assert {
        "nograd_requests_total",
        "nograd_request_duration_seconds_bucket",
        "nograd_request_duration_seconds_count",
        "nograd_queue_depth",
        "nograd_device_memory_allocated_bytes",
        "nograd_device_memory_budget_bytes",
    } <= exported
    assert "nograd_requests" not in exported  # a counter's family name is not a series


def test_dashboard_queries_name_only_exported_metrics(
    dashboard: dict[str, Any], exported: set[str]
) -> None:
    unknown: list[str] = []
    queries = list(_dashboard_queries(dashboard))
    assert queries
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown.extend(f"{where}: {name}" for name in names - exported - PROMETHEUS_SERIES)
    unknown.extend(
        f"{where}: {name}"
        for where, name in _variable_metrics(dashboard)
        if name not in exported | PROMETHEUS_SERIES
    )
    assert not unknown, "metrics nograd does not export:\n" + "\n".join(unknown)


def test_alert_rules_name_only_exported_metrics(exported: set[str]) -> None:
    unknown = [
        f"{rule['alert']}: {name}"
        for rule in alerting_rules()
        for name in promql_metric_names(rule["expr"])
        if name not in exported | PROMETHEUS_SERIES
    ]
    assert not unknown, "metrics nograd does not export:\n" + "\n".join(unknown)


def test_dashboard_covers_the_issue_panels(dashboard: dict[str, Any]) -> None:
    """Throughput, latency, queue, batch sizes, memory vs budget, limit, rejections, OOMs, ready."""
    used = set().union(*(promql_metric_names(expr) for _, expr in _dashboard_queries(dashboard)))
    required = {
        "nograd_requests_total",
        "nograd_request_duration_seconds_bucket",
        "nograd_queue_depth",
        "nograd_batch_size_bucket",
        "nograd_device_memory_allocated_bytes",
        "nograd_device_memory_reserved_bytes",
        "nograd_device_memory_total_bytes",
        "nograd_device_memory_budget_bytes",
        "nograd_batch_limit",
        "nograd_rejected_total",
        "nograd_oom_total",
        "nograd_batch_splits_total",
        "nograd_model_ready",
    }
    assert required <= used, f"no panel shows {sorted(required - used)}"
    latency = [e for _, e in _dashboard_queries(dashboard) if "request_duration_seconds" in e]
    for quantile in ("0.5", "0.95", "0.99"):
        assert any(
            e.startswith(f"histogram_quantile({quantile},") and "by (model, le)" in e
            for e in latency
        ), f"no per-model p{quantile} latency"


def test_dashboard_layout(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert dashboard["uid"] == "nograd"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["description"].strip(), f"{panel['title']}: say what the panel shows"
        # Every query goes through the dashboard's data source variable, so the dashboard
        # works against any Prometheus data source, not just the provisioned one.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_queries_parse(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """PromQL's own parser, through promtool: each query becomes a recording rule."""
    rules = [
        {"record": f"dashboard:query_{n}", "expr": _substitute(expr)}
        for n, (_, expr) in enumerate(_dashboard_queries(dashboard))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def test_provisioning_matches_compose() -> None:
    """Grafana in docker-compose.yml mounts the provisioning and dashboards where they point."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    grafana = services["grafana"]
    assert "grafana/grafana" in grafana["image"]
    assert "3000:3000" in grafana["ports"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = dict(
        (volume.split(":")[0], volume.split(":")[1])
        for volume in grafana["volumes"]
        if volume.startswith("./")
    )
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards_mount = mounts["./deploy/grafana/dashboards"]

    providers = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "dashboards" / "nograd.yml").read_text()
    )["providers"]
    assert [p["options"]["path"] for p in providers] == [dashboards_mount]
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_mount + "/")
    assert (GRAFANA_DIR / "dashboards" / home.removeprefix(dashboards_mount + "/")).is_file()

    datasources = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    (source,) = datasources
    assert source["type"] == "prometheus"
    assert source["uid"] == "prometheus"
    assert any(port.endswith(":9090") for port in services["prometheus"]["ports"])
    assert source["url"] == "http://prometheus:9090"

    # Prometheus gets the rules folder next to its config, where rule_files looks.
    prometheus = services["prometheus"]
    assert "./deploy/prometheus/rules:/etc/prometheus/rules:ro" in prometheus["volumes"]
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert "rules/*.yml" in config["rule_files"]
