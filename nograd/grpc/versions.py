"""A gRPC call's ``model_version`` as Triton reads it, for every RPC that names a version (one
rule, so a stream's requests find the version ModelInfer's would)."""

from __future__ import annotations

import re
from typing import Final

from nograd.serving.errors import InvalidInput

_VERSION_PREFIX: Final = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
"""What C's ``std::stol`` reads of a version string, as Triton's ``GetModelVersionFromString``
reads it (leading blanks, a sign, digits; the rest ignored)."""
_LONG_MAX: Final = 2**63 - 1


def requested_version(text: str) -> str | None:
    """A call's ``model_version`` as Triton reads it: empty is the model's default (None), else
    the number its digits begin with; one that is no number, or a negative one, is refused with
    Triton's words (its explicit-content example client checks them)."""
    if not text:
        return None
    found = _VERSION_PREFIX.match(text)
    digits = found[1].lstrip("+-").lstrip("0") if found is not None else ""
    if found is None or len(digits) > len(str(_LONG_MAX)) or abs(int(found[1])) > _LONG_MAX:
        raise InvalidInput(
            f"failed to get model version from specified version string '{text}' (details: "
            "stol), version should be an integral value > 0"
        )
    version = int(found[1])
    if version < 0:
        raise InvalidInput(
            f"invalid model version specified '{text}' , version should be an integral value > 0"
        )
    return str(version)
