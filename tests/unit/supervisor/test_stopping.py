"""Copies of one stop are one stop; only a later interrupt forces an exit."""

from __future__ import annotations

import signal

from nograd.supervisor.stopping import StopSignals, Verdict, describe


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_stop_signal_drains_and_its_copies_change_nothing() -> None:
    clock = Clock()
    stops = StopSignals(window_s=1.0, clock=clock)
    assert not stops.stopping
    assert stops.receive(signal.SIGTERM) is Verdict.DRAIN
    assert stops.stopping
    clock.now += 0.001
    assert stops.receive(signal.SIGTERM) is Verdict.SAME  # make passing its copy on
    assert stops.receive(signal.SIGINT) is Verdict.SAME  # Ctrl+C reaching the group at once
    clock.now += 60
    assert stops.receive(signal.SIGTERM) is Verdict.SAME  # SIGTERM never cuts a drain


def test_an_interrupt_after_the_stop_was_acknowledged_forces_an_exit() -> None:
    clock = Clock()
    stops = StopSignals(window_s=1.0, clock=clock)
    assert stops.receive(signal.SIGINT) is Verdict.DRAIN
    clock.now += 0.999
    assert stops.receive(signal.SIGINT) is Verdict.SAME
    clock.now += 0.001
    assert stops.receive(signal.SIGINT) is Verdict.FORCE


def test_every_verdict_is_logged_with_what_it_does() -> None:
    assert describe(signal.SIGTERM, Verdict.DRAIN).startswith("SIGTERM: draining")
    assert "already draining" in describe(signal.SIGTERM, Verdict.SAME)
    assert describe(signal.SIGINT, Verdict.FORCE) == "SIGINT again: exiting without waiting"
