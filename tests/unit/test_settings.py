"""Settings come from NOGRAD_* variables, and a bad value names itself."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from nograd.serving.access import exposure_warnings, startup_refusal
from nograd.settings import SETTING_GROUPS, Settings
from tests.e2e.serving import ROOT


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOGRAD_PORT", "9001")
    monkeypatch.setenv("NOGRAD_HOST", "127.0.0.1")
    monkeypatch.setenv("NOGRAD_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("NOGRAD_MEMORY_BUDGET_BYTES", "1048576")
    settings = Settings()
    assert (settings.port, settings.host, settings.log_level) == (9001, "127.0.0.1", "debug")
    assert settings.memory_budget_bytes == 1 << 20


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("NOGRAD_PORT", "70000"),
        ("NOGRAD_MEMORY_FRACTION", "1.5"),
        ("NOGRAD_LOG_LEVEL", "loud"),
        ("NOGRAD_WORKERS", "many"),
    ],
)
def test_bad_value_is_named(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    message = str(info.value)
    assert variable.removeprefix("NOGRAD_").lower() in message
    assert value in message


def test_workers_are_a_count_or_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().workers == "auto"
    # An app built in-process, not through the nograd command, is one process.
    assert Settings().worker_count == 1
    monkeypatch.setenv("NOGRAD_WORKERS", "3")
    assert (Settings().workers, Settings().worker_count) == (3, 3)
    monkeypatch.setenv("NOGRAD_WORKERS", "0")
    with pytest.raises(ValidationError, match="workers"):
        Settings()


def test_cli_help_lists_every_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nograd", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for group in SETTING_GROUPS:
        assert f"\n{group.title}:\n" in result.stdout
    for field in Settings.model_fields:
        assert f"  --{field.replace('_', '-')} <" in result.stdout
        assert f"[env: NOGRAD_{field.upper()}=]" in result.stdout


def test_either_front_may_be_off_but_not_both() -> None:
    assert Settings(port=0, grpc_port=8001).grpc_port == 8001
    assert Settings(grpc_port=0).port == 8000
    with pytest.raises(ValidationError, match="turn on HTTP or gRPC"):
        Settings(port=0, grpc_port=0)


def test_explicit_model_control_without_keys_is_warned_about_at_start_up() -> None:
    assert exposure_warnings(Settings(model_control="explicit"))
    warning = exposure_warnings(Settings(model_control="explicit"))[0]
    assert "NOGRAD_OPERATOR_API_KEYS" in warning
    keys = {"api_keys": "k1", "operator_api_keys": "op"}
    assert exposure_warnings(Settings(model_control="explicit", **keys)) == ()
    local = Settings(model_control="explicit", model_uploads=True, host="127.0.0.1")
    uploads = exposure_warnings(local)
    assert len(uploads) == 2 and "NOGRAD_MODEL_UPLOADS" in uploads[1]
    assert exposure_warnings(Settings(model_control="none")) == ()
    assert exposure_warnings(Settings(model_control="poll")) == ()


def test_api_keys_without_operator_keys_are_warned_to_close_the_operator_apis() -> None:
    (warning,) = exposure_warnings(Settings(api_keys="k1"))
    assert "NOGRAD_OPERATOR_API_KEYS" in warning and "refused to every caller" in warning
    # With no operator group, API keys open every route, as before operator keys existed.
    assert exposure_warnings(Settings(api_keys="k1", operator_apis="")) == ()


def test_uploads_off_loopback_without_a_key_for_load_calls_refuse_to_start() -> None:
    refusal = startup_refusal(Settings(model_control="explicit", model_uploads=True))
    assert refusal is not None and "NOGRAD_OPERATOR_API_KEYS" in refusal
    remote = Settings(model_control="explicit", model_uploads=True, host="10.0.0.5")
    assert "on host '10.0.0.5'" in (startup_refusal(remote) or "")
    for host in ("127.0.0.1", "::1", "localhost"):
        local = Settings(model_control="explicit", model_uploads=True, host=host)
        assert startup_refusal(local) is None
    keyed = Settings(model_control="explicit", model_uploads=True, operator_api_keys="op-key")
    assert startup_refusal(keyed) is None
    # API keys guard load calls only where model-repository is no operator group.
    open_control = {"api_keys": "k1", "operator_apis": "trace"}
    assert (
        startup_refusal(Settings(model_control="explicit", model_uploads=True, **open_control))
        is None
    )


def test_operator_apis_are_triton_s_group_names() -> None:
    assert Settings(operator_apis="trace, logging").operator_api_groups == {"trace", "logging"}
    with pytest.raises(ValidationError, match="unknown API group 'inference'"):
        Settings(operator_apis="trace,inference")


def test_the_byte_budget_must_hold_one_request_at_both_limits() -> None:
    mib = 1024 * 1024
    Settings(max_request_bytes=mib, max_decoded_bytes=mib, max_body_bytes_in_flight=3 * mib)
    with pytest.raises(ValidationError, match="must hold one request at both limits"):
        Settings(max_request_bytes=mib, max_decoded_bytes=mib, max_body_bytes_in_flight=2 * mib)
