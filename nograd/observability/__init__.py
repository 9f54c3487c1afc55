"""Prometheus metrics, the V2 statistics shared across worker processes, and log formatting."""
