"""One request of a sequence as the model receives it: the control and state tensors the server
adds to the client's inputs, and the sequence's id and flags (Triton's Python backend reads them
as ``correlation_id()`` and ``flags()``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np

FLAG_START: Final = 1
"""Triton's ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``."""
FLAG_END: Final = 2
"""Triton's ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_END``."""


@dataclass(frozen=True)
class SequenceStep:
    correlation_id: int | str
    flags: int = 0
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    """Control inputs and implicit states, shaped as the request's inputs (batch rows first)."""
