"""API keys as calls carry them: ``authorization: Bearer <key>``, checked in constant time.

One check for every place a key guards (the fronts through ``Calls.authorize``, the separate
metrics port), so they accept exactly the same header.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Final

KEY_ID_CONTEXT: Final = b"nograd caller id\0"
"""Prefixed to a key before it is digested into its id, so the id is no plain SHA-256 of it."""


def bearer_token(values: Sequence[str | bytes]) -> bytes:
    """The one ``Bearer`` token the call's ``authorization`` values hold; empty when there is
    none, or several values (which of several would count differs between proxies and
    servers)."""
    if len(values) != 1:
        return b""
    value = values[0]
    raw = value.encode("latin-1") if isinstance(value, str) else value
    scheme, _, rest = raw.partition(b" ")
    return rest.strip() if scheme.lower() == b"bearer" else b""


def key_id(values: Sequence[str | bytes]) -> str:
    """An opaque id of the key the call carries (a digest: the key itself is never kept or
    shown), the same in every worker; what the serving core files a caller's state under."""
    return hashlib.sha256(KEY_ID_CONTEXT + bearer_token(values)).hexdigest()[:32]


def bearer_key_matches(values: Sequence[str | bytes], keys: Sequence[bytes]) -> bool:
    """Whether the call's ``authorization`` values hold exactly one ``Bearer`` token equal to one
    of ``keys``; every key is compared, so the time taken says nothing about which matched."""
    token = bearer_token(values)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched and bool(token)
