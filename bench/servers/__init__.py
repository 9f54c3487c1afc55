"""Baseline servers the benchmark runs beside nograd: plain FastAPI, LitServe, the HTTP ceiling."""
