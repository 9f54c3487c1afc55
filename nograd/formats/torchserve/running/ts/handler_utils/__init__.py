"""TorchServe's ``ts.handler_utils``."""
