"""API keys as calls carry them: ``authorization: Bearer <key>``, checked in constant time.

One check for every place a key guards (the fronts through ``Calls.authorize``, the separate
metrics port), so they accept exactly the same header.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence


def bearer_token(values: Sequence[str | bytes]) -> bytes:
    """The token of the call's one ``authorization: Bearer <token>`` value; empty when there is
    none, several values, or another scheme."""
    if len(values) != 1:  # which of several would count differs between proxies and servers
        return b""
    value = values[0]
    raw = value.encode("latin-1") if isinstance(value, str) else value
    scheme, _, rest = raw.partition(b" ")
    return rest.strip() if scheme.lower() == b"bearer" else b""


def bearer_key_matches(values: Sequence[str | bytes], keys: Sequence[bytes]) -> bool:
    """Whether the call's ``authorization`` values hold exactly one ``Bearer`` token equal to one
    of ``keys``; every key is compared, so the time taken says nothing about which matched."""
    token = bearer_token(values)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched and bool(token)
