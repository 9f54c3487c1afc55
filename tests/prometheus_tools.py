"""Shared by the Prometheus-facing tests: the real binaries, the rule files, PromQL metric names.

The tests run Debian's ``prometheus``, ``promtool`` and ``wrk`` rather than re-implementing them.
``scripts/install_debian_package.sh`` installs them on a fresh machine; only where that cannot
work (no root, no apt) do the tests skip, saying why. The metric names nograd exports are read
from ``nograd.observability.metrics.Metrics()``'s registry, never listed by hand.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nograd.observability.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = ROOT / "scripts" / "install_debian_package.sh"
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES_DIR = PROMETHEUS_DIR / "rules"
RULE_TESTS_DIR = PROMETHEUS_DIR / "tests"
GRAFANA_DIR = ROOT / "deploy" / "grafana"


PACKAGES = {"prometheus": ("prometheus", "promtool"), "wrk": ("wrk",), "haproxy": ("haproxy",)}
"""Debian packages the tests run, and the commands each provides."""


@functools.cache
def _install(package: str) -> str:
    """One install attempt per package and test session when a command is missing; its log."""
    commands = PACKAGES[package]
    if all(shutil.which(command) for command in commands):
        return ""
    try:
        done = subprocess.run(
            ["bash", str(INSTALL_SCRIPT), package, *commands],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        return f"exit {done.returncode}: {done.stderr.strip()[-800:]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"


def _tool(command: str, package: str) -> str:
    """The path of ``command``, installing Debian's ``package`` if needed; else skip."""
    log = _install(package)
    path = shutil.which(command)
    if path is None:
        pytest.skip(f"{command} unavailable and {INSTALL_SCRIPT.name} could not install it ({log})")
    return path


def promtool() -> str:
    return _tool("promtool", "prometheus")


def prometheus() -> str:
    return _tool("prometheus", "prometheus")


def wrk() -> str:
    return _tool("wrk", "wrk")


def haproxy() -> str:
    """The fleet's balancer (``nograd fleet``, deploy/fleet/haproxy.cfg)."""
    return _tool("haproxy", "haproxy")


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yml"))


def alerting_rules() -> list[dict[str, Any]]:
    """Every rule with an ``alert`` key in deploy/prometheus/rules/*.yml."""
    rules: list[dict[str, Any]] = []
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(rule for rule in group["rules"] if "alert" in rule)
    return rules


# Series Prometheus itself writes: the scrape health of each target and the alerts' state.
PROMETHEUS_SERIES = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE"})

# Grafana's template variables, replaced by values PromQL accepts before parsing.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "$model": ".*",
    "$instance": ".*",
}

_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"bool", "offset", "inf", "nan"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# An identifier not glued to a preceding word character, dot or $: not a duration unit (5m),
# an exponent (1e-9) or a template variable.
_IDENTIFIER = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, labels, keywords.

    Strings, label matchers, ranges and label lists are removed first, so what remains is the
    expression's skeleton of functions, operators, numbers and metric names.
    """
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    skeleton = _STRING.sub('""', expr)
    skeleton = _MATCHERS.sub(" ", skeleton)
    skeleton = _RANGE.sub(" ", skeleton)
    skeleton = _LABEL_LIST.sub(" ", skeleton)
    names = set()
    for match in _IDENTIFIER.finditer(skeleton):
        name = match.group(1)
        follows = skeleton[match.end() :].lstrip()[:1]
        if follows == "(" or name.lower() in _KEYWORDS:
            continue  # a function call or an operator keyword
        names.add(name)
    return names


def exported_metric_names() -> set[str]:
    """Every series name nograd's registry can expose, with the suffixes each type adds."""
    metrics = Metrics()
    # The device memory collector yields its families only when it has a reading.
    metrics.watch_device_memory(lambda: [("cpu", 1, 1, 1, 1)])
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("", "_sum", "_count"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names
