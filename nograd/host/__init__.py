"""Readings of the host (cores, memory, GPUs) and per-process tuning, all torch-free."""
