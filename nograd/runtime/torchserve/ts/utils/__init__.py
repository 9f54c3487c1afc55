"""TorchServe's ``ts.utils``."""
