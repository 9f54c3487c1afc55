"""Settings every test starts from, unless it sets its own."""

from __future__ import annotations

import os

# gRPC off by default in tests: servers the suite starts side by side would all want port 8001.
# Tests of gRPC set NOGRAD_GRPC_PORT to a free port.
os.environ.setdefault("NOGRAD_GRPC_PORT", "0")
