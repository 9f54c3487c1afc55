"""Tables (Markdown) and the latency-vs-throughput plot (PNG) from one run's results."""

from bench.report.document import markdown
from bench.report.paired import paired_ratios, paired_targets
from bench.report.plot import plot

__all__ = ["markdown", "paired_ratios", "paired_targets", "plot"]
