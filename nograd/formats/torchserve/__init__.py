"""TorchServe model archives (``.mar``): unpacked, read from their manifest, and run by their
own handler as TorchServe runs it."""
