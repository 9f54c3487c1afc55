"""nograd: a PyTorch model server with memory-sized dynamic batching."""

__version__ = "0.1.0"
