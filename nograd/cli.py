"""``nograd`` / ``python -m nograd``: command-line flags map one-to-one onto the Settings fields."""

from __future__ import annotations

import logging
import os
import sys

from nograd.host.openmp import SPIN_COUNT, tune_openmp_wait
from nograd.observability.logs import setup_logging
from nograd.settings import Settings
from nograd.supervisor.plan import resolve_workers
from nograd.supervisor.supervisor import supervise

SERVE_WORKER = "nograd.http.server:serve_worker"
"""What each worker process serves with; named, so the supervisor process never imports it."""


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=argv if argv is not None else True, _cli_prog_name="nograd")
    setup_logging(settings.log_level, settings.log_format)
    settings, planned = resolve_workers(settings)
    if settings.worker_count > 1:
        # The supervisor never imports torch; each worker process loads the models.
        sys.exit(supervise(settings, SERVE_WORKER, fit_to_memory=planned))
    if tune_openmp_wait(os.environ, settings.worker_count):
        logging.getLogger("nograd").info(
            "OpenMP threads spin up to %s iterations between batches (GOMP_SPINCOUNT)", SPIN_COUNT
        )
    from nograd.http.server import serve

    serve(settings)
