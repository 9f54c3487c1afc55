"""Settings every test starts from, unless it sets its own."""

from __future__ import annotations

import os

# gRPC off by default in tests: servers the suite starts side by side would all want port 8001.
# Tests of gRPC set NOGRAD_GRPC_PORT to a free port.
os.environ.setdefault("NOGRAD_GRPC_PORT", "0")

# Eager torch by default: the shipped models' engine = "auto" builds and times engines at every
# start (seconds each), which the many servers this suite starts would pay over and over; it also
# keeps answers bit-for-bit the same across batch sizes, which several tests compare. The engine
# tests (tests/unit/runtime/engines, tests/e2e/test_engines.py) set their own.
os.environ.setdefault("NOGRAD_ENGINE", "eager")
