"""A small MLP whose activations are known analytically, for the tracker and the profiler; a
cost as the planner gets it from one engine's checked fit."""

from __future__ import annotations

import torch

from nograd.runtime.memory import CheckPoint, CostModel, Profile
from nograd.runtime.memory.fits import RangedCost, RangeFit, Verdict, VerifiedFit

MLP_WIDTHS = (512, 1024, 1024, 10)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(MLP_WIDTHS[0], MLP_WIDTHS[1]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP_WIDTHS[1], MLP_WIDTHS[2]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP_WIDTHS[2], MLP_WIDTHS[3]),
    ).eval()


def one_engine(cost: CostModel, engine: str = "eager") -> RangedCost:
    """``cost`` as the plan gets it when one engine serves every batch size and its fit held."""
    fit = VerifiedFit(Profile((), cost, CheckPoint(1, 1, 1, 1.0)), Verdict.FITS, (0.0,), cost)
    return RangedCost((RangeFit(engine, None, fit),))
