"""Errors every layer may raise or map: a request body the wire format does not allow."""

from __future__ import annotations


class DecodeError(ValueError):
    """A request the protocol does not allow; the message names the field and the problem."""


class DecodedTooLarge(DecodeError):
    """A request whose inputs would take more memory decoded than one request may
    (``max_decoded_bytes``): refused before they are decoded."""
