"""``nograd`` / ``python -m app``: command-line flags map one-to-one onto the Settings fields."""

from __future__ import annotations

import logging

import uvicorn

from app.main import create_app
from app.settings import Settings


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=argv if argv is not None else True, _cli_prog_name="nograd")
    configure_logging(settings.log_level)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
    )
