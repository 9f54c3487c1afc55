"""The profiler and the fitted cost model: measured activations, fits, row limits."""

from __future__ import annotations

import pytest
import torch

from nograd.runtime.memory import (
    UNBOUNDED_ROWS,
    CostModel,
    CpuMemoryProbe,
    batch_limit,
    fit_cost_model,
    profile_forward,
)
from tests.unit.runtime.memory.conftest import MLP_WIDTHS, mlp

FLOAT32 = 4


def _analytic_mlp_peak_per_sample() -> int:
    """Peak live activation bytes per sample of ``_mlp`` under inference mode.

    Without autograd nothing is saved for backward: ``nn.Sequential`` rebinds its ``input``
    after each layer, so a layer's input dies as soon as its output exists.  While a layer
    runs, its input and output are alive together; the batch itself stays alive throughout
    because the caller (``run``) holds it.  Activations per sample, in order:
    x=512, linear1=1024, relu=1024, linear2=1024, relu=1024, linear3=10.
    Live floats at each step: x+1024, x+1024+1024, x+1024+1024, x+1024+1024, x+1024+10.
    Peak = 512 + 2 * 1024 = 2560 floats = 10240 bytes.
    """
    acts = [MLP_WIDTHS[0]]
    for width in MLP_WIDTHS[1:]:
        acts += [width, width]  # Linear output, then ReLU output (last layer has no ReLU)
    acts = acts[:-1]
    batch = acts[0]
    steps = [batch + (acts[i - 1] if i > 1 else 0) + acts[i] for i in range(1, len(acts))]
    return max(steps) * FLOAT32


def test_mlp_per_sample_cost_matches_analytic_activations() -> None:
    model = mlp()

    def run(rows: int, length: int) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = model(torch.randn(rows, MLP_WIDTHS[0]))
            return out

    analytic = _analytic_mlp_peak_per_sample()
    assert analytic == 10240
    profile = profile_forward(run, CpuMemoryProbe(), rows=(8, 16, 32, 64))

    assert profile.model.per_unit == pytest.approx(analytic, rel=0.2)
    assert profile.model.quadratic == 0.0
    assert profile.relative_error < 0.05
    # Weights (~5.3 MB) exist before the forward and must not be billed to it.
    assert profile.model.fixed < analytic


def _attention(rows: int, length: int, dim: int = 32) -> torch.Tensor:
    with torch.inference_mode():
        x = torch.randn(rows, length, dim)
        return torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x


def test_sequence_model_quadratic_fit_predicts_check_point() -> None:
    profile = profile_forward(
        _attention,
        CpuMemoryProbe(),
        rows=(2, 4, 8),
        lengths=(16, 32, 64),
        check=(12, 96),
        quadratic=True,
    )
    assert profile.check_point.rows == 12
    assert profile.check_point.length == 96
    assert profile.relative_error < 0.25
    # Scores and softmax are both n*L*L floats alive together: ~8 bytes per n*L^2.
    assert profile.model.quadratic == pytest.approx(2 * FLOAT32, rel=0.25)
    # Without the quadratic term the same grid extrapolates badly in length.
    linear_only = fit_cost_model(profile.points, quadratic=False)
    assert abs(linear_only.predict(12, 96) - profile.check_point.measured_bytes) > abs(
        profile.check_point.predicted_bytes - profile.check_point.measured_bytes
    )


def test_profile_rejects_check_point_inside_grid() -> None:
    with pytest.raises(ValueError, match="check point"):
        profile_forward(_attention, CpuMemoryProbe(), rows=(2, 4), lengths=(8,), check=(4, 8))


def test_profile_default_check_is_beyond_the_grid() -> None:
    profile = profile_forward(lambda n, _: torch.empty(n, 256), CpuMemoryProbe(), rows=(1, 2, 4))
    assert (profile.check_point.rows, profile.check_point.length) == (6, 1)
    assert profile.model.per_unit == pytest.approx(256 * FLOAT32)
    assert profile.relative_error == pytest.approx(0.0, abs=1e-9)


def test_fit_recovers_linear_coefficients() -> None:
    points = [(n, 1, 4096 + 300 * n) for n in (1, 2, 4, 8, 16)]
    model = fit_cost_model(points, quadratic=False)
    assert model.fixed == pytest.approx(4096)
    assert model.per_unit == pytest.approx(300)
    assert model.quadratic == 0.0


def test_fit_recovers_quadratic_coefficients() -> None:
    def cost(n: int, length: int) -> int:
        return 2048 + 64 * n * length + 8 * n * length * length

    points = [(n, length, cost(n, length)) for n in (1, 2, 4) for length in (8, 16, 32, 64)]
    model = fit_cost_model(points, quadratic=True)
    assert model.fixed == pytest.approx(2048, rel=1e-6)
    assert model.per_unit == pytest.approx(64, rel=1e-6)
    assert model.quadratic == pytest.approx(8, rel=1e-6)
    assert model.predict(16, 128) == pytest.approx(cost(16, 128))


def test_fit_never_returns_negative_coefficients() -> None:
    # A negative intercept is an artefact (e.g. a reused buffer); clamping must refit slope.
    points = [(n, 1, 100 * n - 50) for n in (2, 4, 8)]
    model = fit_cost_model(points, quadratic=False)
    assert model.fixed == 0.0
    assert 90 < model.per_unit < 100


def test_fit_needs_two_lengths_for_quadratic() -> None:
    with pytest.raises(ValueError, match="two lengths"):
        fit_cost_model([(1, 8, 100), (2, 8, 200), (4, 8, 400)], quadratic=True)


def test_cost_model_rejects_negative_coefficients() -> None:
    with pytest.raises(ValueError):
        CostModel(fixed=-1.0, per_unit=1.0)


def test_max_rows_boundaries() -> None:
    model = CostModel(fixed=100.0, per_unit=10.0)
    assert model.max_rows(109) == 0
    assert model.max_rows(110) == 1
    assert model.max_rows(169) == 6
    assert model.max_rows(170) == 7
    assert model.predict(7) == 170
    # Awkward floats must still give the exact answer.
    tricky = CostModel(fixed=0.0, per_unit=0.1)
    assert tricky.max_rows(0.3) == max(n for n in range(10) if tricky.predict(n) <= 0.3)


def test_max_rows_is_monotone_in_budget() -> None:
    model = CostModel(fixed=1000.0, per_unit=37.0, quadratic=3.0)
    limits = [model.max_rows(budget, length=5) for budget in range(0, 20000, 7)]
    assert limits == sorted(limits)
    for budget, limit in zip(range(0, 20000, 7), limits, strict=True):
        assert limit == 0 or model.predict(limit, 5) <= budget
        assert model.predict(limit + 1, 5) > budget


def test_max_tokens_and_length_scaling() -> None:
    model = CostModel(fixed=0.0, per_unit=1.0, quadratic=1.0)
    assert model.per_row(4) == 4 + 16
    assert model.max_rows(200, length=4) == 10
    assert model.max_tokens(200, length=4) == 40
    assert model.max_rows(200, length=8) < model.max_rows(200, length=4)


def test_max_rows_without_per_row_cost_is_unbounded() -> None:
    assert CostModel(fixed=10.0, per_unit=0.0).max_rows(10) == UNBOUNDED_ROWS
    assert CostModel(fixed=10.0, per_unit=0.0).max_rows(9) == 0


def test_batch_limit() -> None:
    model = CostModel(fixed=0.0, per_unit=1000.0)
    assert batch_limit(model, share_bytes=1_000_000, max_batch_size=32) == 32
    assert batch_limit(model, share_bytes=10_500, max_batch_size=32) == 10
    assert batch_limit(model, share_bytes=999, max_batch_size=32) == 0
    seq = CostModel(fixed=0.0, per_unit=10.0, quadratic=1.0)
    assert batch_limit(seq, share_bytes=200 * 15 + 199, max_batch_size=64, length=10) == 15
