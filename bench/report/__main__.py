"""``python -m bench.report FILE``: re-render the tables and the plot of a results file."""

from __future__ import annotations

from pathlib import Path

from bench.report.document import markdown
from bench.report.plot import plot


def main(argv: list[str] | None = None) -> None:
    """Re-render the tables and the plot of a results file: ``python -m bench.report FILE``."""
    import argparse

    import orjson

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    results = orjson.loads(args.results.read_bytes())
    args.results.with_suffix(".md").write_text(markdown(results))
    plot(results, args.results.with_suffix(".png"))
    print(args.results.with_suffix(".md"))


if __name__ == "__main__":
    main()
