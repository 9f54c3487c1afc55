"""A small MLP whose activations are known analytically, for the tracker and the profiler."""

from __future__ import annotations

import torch

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
