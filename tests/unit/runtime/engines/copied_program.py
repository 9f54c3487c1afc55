"""An engine added the way every engine is: this module and one row of the table
(``nograd.core.engines``). It stores the program as ``torch.export`` does, under its own name,
and measures its memory the default way."""

from __future__ import annotations

from nograd.core.engines import EngineRow
from nograd.runtime.engines.program import TorchExportEngine

ROW = EngineRow("copied_program", ".copied.pt2", f"{__name__}:ENGINE", reads_signature=True)
ENGINE = TorchExportEngine(ROW)
