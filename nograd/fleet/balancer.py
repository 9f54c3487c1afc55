"""The fleet's HAProxy: started on the shipped configuration (deploy/fleet/haproxy.cfg, whose
variables come from the environment), and steered through its Runtime API (the stats socket):
a replica slot gets its address and leaves maintenance, drains, or goes back to maintenance."""

from __future__ import annotations

import csv
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

CONFIG: Final = Path(__file__).resolve().parents[2] / "deploy" / "fleet" / "haproxy.cfg"
"""The configuration the fleet runs; deploy/k8s/fleet carries the same file."""
BACKENDS: Final = ("replicas_http", "replicas_grpc")
"""HAProxy's backends of the replicas: each replica has slot ``replica<N>`` in both."""
BALANCES: Final = ("model", "roundrobin")
INSTALL_HINT: Final = "install Debian's haproxy (scripts/install_debian_package.sh haproxy haproxy)"
SOCKET_TIMEOUT_S: Final = 5.0
CHANGE_ANSWERS: Final = ("IP changed from", "no need to change the addr", "health check port")
"""How HAProxy's ``set server`` answers a change it made (a state change answers nothing)."""


class BalancerError(RuntimeError):
    """HAProxy is missing, refused its configuration or a Runtime API command."""


def haproxy_binary() -> str:
    found = shutil.which("haproxy")
    if found is None:
        raise BalancerError(f"haproxy not found on PATH: {INSTALL_HINT}")
    return found


def balancer_env(
    host: str, port: int, grpc_port: int, socket_path: Path, balance: str, slots: int
) -> dict[str, str]:
    """The variables deploy/fleet/haproxy.cfg reads, for a fleet on one machine."""
    if balance not in BALANCES:
        raise BalancerError(f"balance {balance!r} is not one of {', '.join(BALANCES)}")
    return {
        "NOGRAD_FLEET_HTTP_BIND": f"{host}:{port}",
        "NOGRAD_FLEET_GRPC_BIND": f"{host}:{grpc_port}",
        "NOGRAD_FLEET_SOCKET": str(socket_path),
        "NOGRAD_FLEET_BALANCE": balance,
        "NOGRAD_FLEET_SLOTS": str(slots),
    }


def check_config(config: Path, env: Mapping[str, str]) -> None:
    """``haproxy -c``: the configuration as HAProxy would read it with ``env``."""
    done = subprocess.run(
        [haproxy_binary(), "-c", "-f", str(config)],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        raise BalancerError(f"haproxy -c {config}: {(done.stdout + done.stderr).strip()}")


def start_balancer(config: Path, env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """HAProxy in the foreground of a session of its own (it outlives the command that started
    it), its warnings in ``log``; returns once its Runtime API answers."""
    check_config(config, env)
    with log.open("ab") as out:
        process = subprocess.Popen(
            [haproxy_binary(), "-f", str(config)],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    api = RuntimeApi(Path(env["NOGRAD_FLEET_SOCKET"]))
    deadline = time.monotonic() + 10
    while True:
        if process.poll() is not None:
            raise BalancerError(f"haproxy exited with {process.returncode}: {log.read_text()}")
        try:
            api.command("show info")
            return process
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise BalancerError(f"haproxy's socket did not answer: {log.read_text()}") from None
            time.sleep(0.05)


@dataclass(frozen=True)
class SlotStat:
    """One server slot of one backend, as ``show stat`` reports it."""

    backend: str
    slot: int
    status: str
    """HAProxy's: ``UP``, ``DOWN``, ``MAINT``, ``DRAIN``, ``UP 1/2`` (going down)..."""
    current_sessions: int
    queued: int


class RuntimeApi:
    """HAProxy's Runtime API on its stats socket: one connection per command."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(SOCKET_TIMEOUT_S)
            conn.connect(str(self.path))
            conn.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def checked(self, line: str) -> str:
        """``line``'s answer: empty, or one of the sentences HAProxy answers a change with;
        anything else is a refusal (HAProxy words those in sentences too) and raises."""
        answer = self.command(line).strip()
        if answer and not answer.startswith(CHANGE_ANSWERS):
            raise BalancerError(f"haproxy refused {line!r}: {answer}")
        return answer

    def place(self, slot: int, http_port: int, grpc_port: int, host: str = "127.0.0.1") -> None:
        """Point slot ``slot`` at a replica (its health checked on its HTTP port); it stays
        in maintenance until ``set_state(slot, "ready")``."""
        self.checked(f"set server replicas_http/replica{slot} addr {host} port {http_port}")
        self.checked(f"set server replicas_grpc/replica{slot} addr {host} port {grpc_port}")
        self.checked(f"set server replicas_grpc/replica{slot} check-port {http_port}")

    def set_state(self, slot: int, state: str) -> None:
        """``ready``, ``drain`` (no new requests; those running finish) or ``maint``."""
        for backend in BACKENDS:
            self.checked(f"set server {backend}/replica{slot} state {state}")

    def set_weight(self, slot: int, weight: int) -> None:
        """Slot ``slot``'s weight in every backend: its share of the hash ring's points."""
        for backend in BACKENDS:
            self.checked(f"set server {backend}/replica{slot} weight {weight}")

    def weight(self, slot: int) -> int:
        """Slot ``slot``'s weight now (HAProxy answers ``92 (initial 100)``)."""
        answer = self.command(f"get weight {BACKENDS[0]}/replica{slot}").split()
        if not answer or not answer[0].isdigit():
            raise BalancerError(f"haproxy's weight of replica{slot}: {' '.join(answer)}")
        return int(answer[0])

    def stats(self) -> list[SlotStat]:
        text = self.command("show stat").lstrip("# ")
        found = []
        for row in csv.DictReader(text.splitlines()):
            name = row.get("svname") or ""
            if row.get("pxname") in BACKENDS and name.startswith("replica"):
                found.append(
                    SlotStat(
                        row["pxname"],
                        int(name.removeprefix("replica")),
                        row["status"],
                        int(row["scur"] or 0),
                        int(row["qcur"] or 0),
                    )
                )
        return found

    def slot_stats(self, slot: int) -> list[SlotStat]:
        return [stat for stat in self.stats() if stat.slot == slot]

    def wait_up(self, slot: int, timeout_s: float) -> None:
        """Until slot ``slot`` is UP in every backend (its health check passed)."""
        deadline = time.monotonic() + timeout_s
        while not all(stat.status == "UP" for stat in self.slot_stats(slot)):
            if time.monotonic() > deadline:
                raise BalancerError(f"replica{slot} not UP in haproxy: {self.slot_stats(slot)}")
            time.sleep(0.1)

    def wait_idle(self, slot: int, timeout_s: float) -> bool:
        """Until no request runs or waits on slot ``slot`` (or ``timeout_s``: False)."""
        deadline = time.monotonic() + timeout_s
        while any(stat.current_sessions or stat.queued for stat in self.slot_stats(slot)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
