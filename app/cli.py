"""``nograd`` / ``python -m app``: command-line flags map one-to-one onto the Settings fields."""

from __future__ import annotations

from app.logs import setup_logging
from app.server import serve
from app.settings import Settings


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=argv if argv is not None else True, _cli_prog_name="nograd")
    setup_logging(settings.log_level, settings.log_format)
    serve(settings)
