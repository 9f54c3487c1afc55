"""deploy/prometheus/rules: promtool accepts them, and the promtool unit tests cover every alert."""

from __future__ import annotations

import subprocess
from collections import defaultdict
from typing import Any

import yaml

from tests.prometheus_tools import (
    PROMETHEUS_DIR,
    RULE_TESTS_DIR,
    alerting_rules,
    promtool,
    rule_files,
)

# The alerts issue 7 asks for, by what they watch.
REQUIRED_ALERTS = {
    "NogradLatencyP99AboveSLO",  # p99 over an SLO
    "NogradQueueSaturated",  # queue saturation
    "NogradHighErrorRatio",  # error ratio
    "NogradOutOfMemory",  # OOM splits
    "NogradBatchSplitsHigh",
    "NogradDeviceMemoryNearCapacity",  # memory near budget
    "NogradBatchMemoryNearBudget",
    "NogradModelNotReady",  # model not ready
    "NogradTargetDown",
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_check_rules() -> None:
    files = [str(path) for path in rule_files()]
    assert files, "no rule files in deploy/prometheus/rules"
    done = _run(promtool(), "check", "rules", *files)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_check_config_loads_the_rules() -> None:
    """The compose Prometheus config references the rules (rule_files) and is valid."""
    done = _run(promtool(), "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    for path in rule_files():
        assert path.name in done.stdout, f"{path} not loaded by prometheus.yml:\n{done.stdout}"


def test_promtool_unit_tests_pass() -> None:
    tests = sorted(str(path) for path in RULE_TESTS_DIR.glob("*.yml"))
    assert tests, "no promtool rule tests in deploy/prometheus/tests"
    done = _run(promtool(), "test", "rules", *tests)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: dict[str, int] = defaultdict(int)
    quiet: dict[str, int] = defaultdict(int)
    for path in RULE_TESTS_DIR.glob("*.yml"):
        document: dict[str, Any] = yaml.safe_load(path.read_text())
        for case in document["tests"]:
            for check in case.get("alert_rule_test", []):
                target = firing if check.get("exp_alerts") else quiet
                target[check["alertname"]] += 1
    names = {rule["alert"] for rule in alerting_rules()}
    assert not names - set(firing), f"alerts never tested firing: {sorted(names - set(firing))}"
    assert not names - set(quiet), f"alerts never tested quiet: {sorted(names - set(quiet))}"
    assert not (set(firing) | set(quiet)) - names, "tests name alerts that do not exist"


def test_issue_alerts_present() -> None:
    names = {rule["alert"] for rule in alerting_rules()}
    assert names >= REQUIRED_ALERTS, f"missing: {sorted(REQUIRED_ALERTS - names)}"


def test_alerts_carry_severity_and_text() -> None:
    """Routing needs a severity; a page needs a summary and a description that say what to do."""
    names = [rule["alert"] for rule in alerting_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in alerting_rules():
        assert rule["alert"].startswith("Nograd"), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]
