"""Errors every layer may raise or map: a request body the wire format does not allow."""

from __future__ import annotations


class DecodeError(ValueError):
    """A request the protocol does not allow; the message names the field and the problem."""
