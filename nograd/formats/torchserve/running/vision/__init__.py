"""The part of torchvision that TorchServe's image handlers use, imported as ``torchvision`` by
archive code when torchvision itself is not installed: PyPI's torchvision wheels are built for
PyPI's CUDA torch and do not import beside a CPU build (docs/torchserve.md)."""
