"""TorchServe model archives run as TorchServe runs them: the handler's ``initialize`` and
``handle``, with nograd's own ``ts`` package standing in for TorchServe's (``ts/``)."""
