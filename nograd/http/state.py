"""Typed access to what the app holds, so routes never reach into ``app.state`` untyped."""

from __future__ import annotations

from fastapi import Request

from nograd.formats.torchserve.api.management import TorchServeManagement
from nograd.observability.metrics import Metrics
from nograd.serving.calls.lifecycle import Calls
from nograd.serving.control.model_control import ModelControl
from nograd.serving.dataplane import DataPlane
from nograd.serving.extensions.diagnostics import Diagnostics
from nograd.serving.residency.placement import Placement


def dataplane_of(request: Request) -> DataPlane:
    plane = request.app.state.dataplane
    assert isinstance(plane, DataPlane)
    return plane


def metrics_of(request: Request) -> Metrics:
    metrics = request.app.state.metrics
    assert isinstance(metrics, Metrics)
    return metrics


def control_of(request: Request) -> ModelControl:
    control = request.app.state.control
    assert isinstance(control, ModelControl)
    return control


def calls_of(request: Request) -> Calls:
    calls = request.app.state.calls
    assert isinstance(calls, Calls)
    return calls


def torchserve_of(request: Request) -> TorchServeManagement:
    management = request.app.state.torchserve
    assert isinstance(management, TorchServeManagement)
    return management


def diagnostics_of(request: Request) -> Diagnostics:
    diagnostics = request.app.state.diagnostics
    assert isinstance(diagnostics, Diagnostics)
    return diagnostics


def placement_of(request: Request) -> Placement:
    placement = request.app.state.placement
    assert isinstance(placement, Placement)
    return placement
