"""``nograd`` / ``python -m app``: command-line flags map one-to-one onto the Settings fields."""

from __future__ import annotations

import logging
import os
import sys

from app.logs import setup_logging
from app.runtime.openmp import SPIN_COUNT, tune_openmp_wait
from app.settings import Settings


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=argv if argv is not None else True, _cli_prog_name="nograd")
    setup_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        # The supervisor never imports torch; each worker process loads the models.
        from app.workers import supervise

        sys.exit(supervise(settings))
    if tune_openmp_wait(os.environ, settings.workers):
        logging.getLogger("app").info(
            "OpenMP threads spin up to %s iterations between batches (GOMP_SPINCOUNT)", SPIN_COUNT
        )
    from app.server import serve

    serve(settings)
