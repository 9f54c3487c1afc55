"""nograd's stand-in for TorchServe's ``ts`` package: what handlers import from it (the base and
default handlers, the context, ``PredictionException``), imported as ``ts`` by archive code.

TorchServe's own package needs its Java frontend's worker protocol, unpickles checkpoints with
``torch.load`` without ``weights_only`` and imports captum for explanations; this one serves the
same handler contract inside nograd's batcher (docs/torchserve.md)."""

__version__ = "0.12.0"
