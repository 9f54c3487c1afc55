"""The fleet's pieces without replicas: deploy/fleet/haproxy.cfg as HAProxy reads it in each
deployment (one machine, model-aware or round robin; Kubernetes from DNS), the balancer started
on it with its slots in maintenance, the state file and the replicas' settings."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from nograd.fleet.balancer import (
    BACKENDS,
    CONFIG,
    BalancerError,
    RuntimeApi,
    balancer_env,
    check_config,
    start_balancer,
)
from nograd.fleet.command import fleet_command
from nograd.fleet.replicas import replica_settings, stop_process
from nograd.fleet.state import Fleet, Replica, alive, load, save, state_path, state_root
from tests.e2e.serving import free_port
from tests.prometheus_tools import haproxy

KUBERNETES_ENV = {
    "NOGRAD_FLEET_DNS": "nograd-replicas.default.svc.cluster.local",
    "NOGRAD_FLEET_HTTP_PORT": "8000",
    "NOGRAD_FLEET_GRPC_PORT": "8001",
}


def _env(tmp_path: Path, balance: str = "model", slots: int = 4) -> dict[str, str]:
    return balancer_env(
        "127.0.0.1", free_port(), free_port(), tmp_path / "api.sock", balance, slots
    )


@pytest.mark.parametrize("balance", ["model", "roundrobin"])
@pytest.mark.parametrize("kubernetes", [False, True], ids=["one-machine", "kubernetes"])
def test_haproxy_accepts_the_config(tmp_path: Path, balance: str, kubernetes: bool) -> None:
    haproxy()
    env = _env(tmp_path, balance)
    check_config(CONFIG, {**env, **(KUBERNETES_ENV if kubernetes else {})})


def test_config_hashes_the_model_name_unless_round_robin() -> None:
    text = CONFIG.read_text()
    assert text.count("balance hash var(txn.model)") == len(BACKENDS)
    assert text.count("hash-type consistent") == len(BACKENDS)
    assert text.count("hash-balance-factor") == len(BACKENDS)
    assert text.count("balance roundrobin") == len(BACKENDS)
    assert "req.hdr(x-nograd-model)" in text
    assert "json_query('$.model')" in text


def test_unknown_balance_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BalancerError, match="balance 'leastconn'"):
        _env(tmp_path, "leastconn")


def test_a_missing_variable_fails_the_check(tmp_path: Path) -> None:
    haproxy()
    env = _env(tmp_path)
    del env["NOGRAD_FLEET_HTTP_BIND"]
    with pytest.raises(BalancerError, match="bind"):
        check_config(CONFIG, env)


def test_balancer_starts_with_every_slot_in_maintenance(tmp_path: Path) -> None:
    haproxy()
    env = _env(tmp_path, slots=3)
    process = start_balancer(CONFIG, env, tmp_path / "haproxy.log")
    try:
        api = RuntimeApi(tmp_path / "api.sock")
        stats = api.stats()
        assert {(s.backend, s.slot) for s in stats} == {(b, n) for b in BACKENDS for n in (1, 2, 3)}
        assert {s.status for s in stats} == {"MAINT"}
        # A slot pointed at a port where nothing listens goes DOWN once out of maintenance.
        api.place(2, free_port(), free_port())
        api.set_state(2, "ready")
        with pytest.raises(BalancerError, match="replica2 not UP"):
            api.wait_up(2, timeout_s=3)
        with pytest.raises(BalancerError, match="refused"):
            api.set_state(9, "ready")
    finally:
        stop_process(process.pid, 10)
    assert not alive(process.pid)


def test_state_round_trips_and_only_its_user_reads_it(tmp_path: Path) -> None:
    fleet = Fleet(
        port=9000,
        grpc_port=9001,
        host="127.0.0.1",
        balance="model",
        slots=4,
        balancer_pid=1,
        socket="s",
        folder="f",
        replica_env={"NOGRAD_API_KEYS": "secret"},
        replicas=[Replica(1, 2, 3, 4, "log"), Replica(3, 5, 6, 7, "log")],
    )
    path = state_path(tmp_path / "run", 9000)
    save(fleet, path)
    assert load(path) == fleet
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert fleet.free_slots() == [2, 4]
    assert fleet.replica(3).pid == 5


def test_state_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert state_root(tmp_path) == tmp_path
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert state_root(None) == tmp_path / "xdg" / "nograd-fleet"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert state_root(None).name.startswith("nograd-fleet-")


def test_replicas_get_the_settings_but_their_own_address() -> None:
    environ = {
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_PORT": "8000",
        "NOGRAD_GRPC_PORT": "8001",
        "NOGRAD_HOST": "0.0.0.0",
        "PATH": "/bin",
    }
    assert replica_settings(environ) == {
        "NOGRAD_MODEL_CONTROL": "on_demand",
        "NOGRAD_WORKERS": "1",
        "NOGRAD_FRONTS": "0",
    }
    # A process plan the environment names is the replicas' own.
    chosen = {**environ, "NOGRAD_FRONTS": "2"}
    assert replica_settings(chosen) == {"NOGRAD_MODEL_CONTROL": "on_demand", "NOGRAD_FRONTS": "2"}


def test_a_command_for_a_port_without_a_fleet_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for action in (["down"], ["rolling-restart"], ["scale", "--replicas", "2"]):
        assert fleet_command([*action, "--port", "9", "--state-dir", str(tmp_path)]) == 1
        assert "no fleet on port 9" in capsys.readouterr().err


def test_up_on_a_taken_port_fails_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    haproxy()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["up", "--replicas", "1", "--port", str(port), "--state-dir", str(tmp_path)]
        assert fleet_command(argv) == 1
    assert "haproxy exited" in capsys.readouterr().err
    assert not state_path(tmp_path, port).exists()


def test_up_refuses_more_replicas_than_slots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    haproxy()
    argv = ["up", "--replicas", "3", "--slots", "2", "--port", str(free_port())]
    assert fleet_command([*argv, "--state-dir", str(tmp_path)]) == 1
    assert "--replicas must be 1..2" in capsys.readouterr().err
