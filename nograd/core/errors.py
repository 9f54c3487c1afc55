"""Errors every layer may raise or map: a request body the wire format does not allow."""

from __future__ import annotations


class DecodeError(ValueError):
    """A request the protocol does not allow; the message names the field and the problem."""


class ModelAnswered(Exception):
    """A request a model's own code answered with an error (Triton's Python backend's
    ``InferenceResponse(error=...)``): the message goes to the client as the model wrote it,
    with the HTTP status its error code stands for, and the code's name (``INVALID_ARG``), from
    which gRPC takes its status code as Triton's gRPC front does."""

    def __init__(self, message: str, status: int, code: str = "INTERNAL") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class DecodedTooLarge(DecodeError):
    """A request whose inputs would take more memory decoded than one request may
    (``max_decoded_bytes``): refused before they are decoded."""
