"""The bench's phases, each a function of the run's ``Bench``."""
