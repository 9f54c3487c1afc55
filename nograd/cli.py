"""``nograd`` / ``python -m nograd``: command-line flags map one-to-one onto the Settings fields;
``--help`` lists them by section (``nograd.settings_reference``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from nograd.core.engines import built_engines
from nograd.host.collector import collect_young_less_often
from nograd.host.heap import use_one_arena
from nograd.host.openmp import SPIN_COUNT, tune_openmp_wait
from nograd.observability.logs import setup_logging
from nograd.serving.calls.access import exposure_warnings
from nograd.settings import Settings
from nograd.settings_reference import help_text
from nograd.supervisor.plan import resolve_fronts, resolve_workers
from nograd.supervisor.supervisor import supervise

SERVE_WORKER = "nograd.server:serve_worker"
"""What each worker process serves with; named, so the supervisor process never imports it."""
SERVE_ENGINE = "nograd.server:serve_engine"
SERVE_FRONT = "nograd.front.server:serve_front"
"""The engine process and each front process (``NOGRAD_FRONTS``)."""
HELP_FLAGS = frozenset({"-h", "--help"})


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["export"]:
        sys.exit(export_command(args[1:]))
    if args[:1] == ["fleet"]:
        from nograd.fleet.command import fleet_command

        sys.exit(fleet_command(args[1:]))
    if HELP_FLAGS.intersection(args):
        # Ours, not the flag parser's: its help knows no sections and no variable names.
        print(help_text(), end="")
        sys.exit(0)
    # Before any thread allocates: the memory plan measures batches in the resident set.
    use_one_arena()
    collect_young_less_often()
    settings = Settings(_cli_parse_args=argv if argv is not None else True, _cli_prog_name="nograd")
    setup_logging(
        settings.log_level,
        settings.log_format,
        keys=settings.api_key_list + settings.operator_key_list,
    )
    for warning in exposure_warnings(settings):
        logging.getLogger("nograd").warning("%s", warning)
    if isinstance(settings.fronts, int) and settings.fronts and settings.worker_count > 1:
        logging.getLogger("nograd").error(
            "NOGRAD_WORKERS=%d with NOGRAD_FRONTS=%d: the fronts forward to one engine "
            "process that holds every model once; unset NOGRAD_WORKERS",
            settings.worker_count,
            settings.fronts,
        )
        sys.exit(2)
    if isinstance(settings.fronts, int) and settings.fronts and not settings.port:
        logging.getLogger("nograd").error(
            "NOGRAD_FRONTS=%d with NOGRAD_PORT=0: the fronts serve HTTP, which is off",
            settings.fronts,
        )
        sys.exit(2)
    settings = resolve_fronts(settings)
    if settings.front_count:
        engine = settings.model_copy(update={"workers": 1})
        sys.exit(supervise(engine, SERVE_ENGINE, front=SERVE_FRONT))
    if isinstance(settings.cpu_batches, int) and settings.cpu_batches > 1:
        if settings.worker_count > 1:
            logging.getLogger("nograd").error(
                "NOGRAD_CPU_BATCHES=%d with NOGRAD_WORKERS=%d: each worker runs one CPU batch "
                "at a time and shares the cores with the others; unset NOGRAD_WORKERS for one "
                "process that runs several",
                settings.cpu_batches,
                settings.worker_count,
            )
            sys.exit(2)
        settings = settings.model_copy(update={"workers": 1})  # one process runs them all
    settings, planned = resolve_workers(settings)
    if settings.worker_count > 1:
        # The supervisor never imports torch; each worker process loads the models.
        sys.exit(supervise(settings, SERVE_WORKER, fit_to_memory=planned))
    batches = settings.cpu_batches if isinstance(settings.cpu_batches, int) else 1
    if tune_openmp_wait(os.environ, max(settings.worker_count, batches)):
        logging.getLogger("nograd").info(
            "OpenMP threads spin up to %s iterations between batches (GOMP_SPINCOUNT)", SPIN_COUNT
        )
    from nograd.server import serve
    from nograd.supervisor.worker import STARTUP_FAILURE

    sys.exit(0 if serve(settings) else STARTUP_FAILURE)


def export_command(argv: list[str]) -> int:
    """``nograd export <model-dir> --to <engine> [--out DIR]``: the model folder's artifact,
    checked against its eager model, in a new model folder (engines: ``nograd.core.engines``)."""
    engines = built_engines()
    parser = argparse.ArgumentParser(
        prog="nograd export",
        description=f"Build a {', '.join(engines)} model folder from a python model folder; "
        "the artifact is checked against the eager model before it is written.",
    )
    parser.add_argument("model_dir", type=Path, help="the python model's folder")
    parser.add_argument("--to", required=True, choices=list(engines))
    parser.add_argument("--out", type=Path, help="folder to write (default: <name>-<to> beside)")
    parser.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (aoti compiles for it)")
    options = parser.parse_args(argv)
    setup_logging("warning", "text")
    # Imported here: serving starts a torch-free supervisor from this module.
    from nograd.runtime.engines.errors import ArtifactError
    from nograd.runtime.engines.export import ExportError, export_model

    try:
        done = export_model(
            options.model_dir, options.to, options.out, options.precision, options.device
        )
    except (ExportError, ArtifactError) as exc:
        print(f"nograd export: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {done.folder} ({done.artifact.name}, {done.artifact.stat().st_size:,} bytes); "
        f"against eager on {done.batches} batches: {done.accuracy.summary()}"
    )
    return 0
