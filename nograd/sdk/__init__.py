"""The public API for model authors: the only part of nograd a model's code imports.

A model folder holds ``config.toml`` (a :class:`ModelConfig`) and ``model.py``, which defines
``build`` (returning a ``torch.nn.Module`` the server loads the weights into) or
``build_handler`` (returning a :class:`ModelHandler` subclass for custom preprocessing, such as a
tokenizer). A handler turns validated request arrays into a :class:`TensorPart` (``prepare``),
runs the batched forward, and states ``max_length`` when it reads sequences.
"""

from nograd.runtime.handler import ModelHandler, Outputs, TensorPart
from nograd.schema.config import ModelConfig, TensorSpec

__all__ = ["ModelConfig", "ModelHandler", "Outputs", "TensorPart", "TensorSpec"]
