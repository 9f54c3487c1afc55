"""Who may call what: API keys guard every protected route and RPC; operator keys alone open the
API groups that change the server (Triton's restricted APIs, ``--http-restricted-api``): model
control and uploads, shared-memory regions, trace and log settings.

A key is checked in constant time against every configured key (``bearer_key_matches``), so
neither the answer's time nor its text says which key matched or how close a wrong one came.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Sequence
from typing import Final

from nograd.protocol.keys import bearer_key_matches, bearer_token
from nograd.serving.errors import Forbidden, Unauthenticated
from nograd.settings import Settings

MODEL_REPOSITORY: Final = "model-repository"
"""Load and unload (uploads too), the repository index, TorchServe's management API."""
SHARED_MEMORY: Final = "shared-memory"
"""Registering, unregistering and listing system and CUDA shared-memory regions."""
TRACE: Final = "trace"
"""The trace settings, global and per model."""
LOGGING: Final = "logging"
"""The log settings (levels, verbosity, format)."""
KEY_HINT: Final = {
    "http": "send one 'Authorization: Bearer <key>' header",
    "grpc": "send metadata 'authorization: Bearer <key>'",
}
RESTRICTED: Final = {"http": "API", "grpc": "protocol"}
"""Triton's word for what is restricted, in its refusal's text, by protocol."""


class Access:
    """The configured keys, and which API groups take operator keys only."""

    def __init__(
        self,
        api_keys: Sequence[str],
        operator_keys: Sequence[str] = (),
        operator_groups: Iterable[str] = (),
    ) -> None:
        self._operator = tuple(key.encode() for key in operator_keys)
        self._any = tuple(key.encode() for key in api_keys) + self._operator
        self._api_keys_set = bool(api_keys)
        self.operator_groups = frozenset(operator_groups)

    @property
    def keys_required(self) -> bool:
        """Whether any call is checked at all (some key is configured)."""
        return bool(self._any)

    def guards(self, group: str | None) -> bool:
        """Whether a call of ``group`` (None: no operator group) needs a key."""
        if group is not None and group in self.operator_groups:
            return bool(self._any)
        return self._api_keys_set

    def caller(self, values: Sequence[str | bytes]) -> str:
        """An opaque id of the key the call carries, the same in every worker and across
        restarts, for keeping apart what each caller holds (its shared-memory regions); a hash,
        so it says nothing of the key. Empty when no configured key came with the call."""
        if not bearer_key_matches(values, self._any):
            return ""
        return hashlib.sha256(b"nograd-caller\0" + bearer_token(values)).hexdigest()[:16]

    def check(self, values: Sequence[str | bytes], protocol: str, group: str | None) -> None:
        """Check the call's ``authorization`` values for a route of ``group``: no valid key
        raises ``Unauthenticated``; a valid key that is no operator key, on an operator group,
        raises ``Forbidden`` naming the group. Never names a key."""
        if not self.guards(group):
            return
        hint = KEY_HINT.get(protocol, KEY_HINT["http"])
        if not bearer_key_matches(values, self._any):
            why = "missing" if not values else "invalid"
            raise Unauthenticated(f"{why} API key: {hint}")
        if group is None or group not in self.operator_groups:
            return
        if bearer_key_matches(values, self._operator):
            return
        what = RESTRICTED.get(protocol, "API")
        if not self._operator:
            raise Forbidden(
                f"This {what} is restricted, expecting an operator key: the {group} API takes "
                "operator keys only, and none is configured (NOGRAD_OPERATOR_API_KEYS)"
            )
        raise Forbidden(
            f"This {what} is restricted, expecting an operator key: the {group} API takes "
            f"operator keys only ({hint} with a key of NOGRAD_OPERATOR_API_KEYS)"
        )


def access_of(settings: Settings) -> Access:
    return Access(settings.api_key_list, settings.operator_key_list, settings.operator_api_groups)


def control_guarded(settings: Settings) -> bool:
    """Whether load calls (uploads too) need a key: an operator key where ``model-repository``
    is an operator group (with API keys only, they are refused to every caller), an API key
    where it is not."""
    if MODEL_REPOSITORY in settings.operator_api_groups:
        return bool(settings.operator_key_list or settings.api_key_list)
    return bool(settings.api_key_list)


def on_loopback(host: str) -> bool:
    """Whether ``host`` (the address the server listens on) is reachable from this machine
    only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def startup_refusal(settings: Settings) -> str | None:
    """Why the server must not start as configured, if it must not: uploads (code the caller
    chose) that anyone who reaches a port other than loopback could send."""
    if not (settings.model_uploads and settings.model_control == "explicit"):
        return None
    if control_guarded(settings) or on_loopback(settings.host):
        return None
    return (
        f"NOGRAD_MODEL_UPLOADS on host {settings.host!r} without NOGRAD_OPERATOR_API_KEYS: "
        "anyone who reaches the port could upload a model, and so run code of their choosing; "
        "set NOGRAD_OPERATOR_API_KEYS, or listen on loopback only (NOGRAD_HOST=127.0.0.1)"
    )


def exposure_warnings(settings: Settings) -> tuple[str, ...]:
    """What the start-up log must say about keys that leave the server open to anyone who
    reaches its ports, or that close APIs: easy to miss in a deployment, costly when missed."""
    warnings: tuple[str, ...] = ()
    groups = settings.operator_api_groups
    if settings.api_key_list and not settings.operator_key_list and groups:
        warnings += (
            f"NOGRAD_API_KEYS without NOGRAD_OPERATOR_API_KEYS: the operator APIs "
            f"({', '.join(sorted(groups))}) are refused to every caller; set "
            "NOGRAD_OPERATOR_API_KEYS to use them",
        )
    if settings.model_control not in ("explicit", "on_demand") or control_guarded(settings):
        return warnings
    warnings += (
        f"NOGRAD_MODEL_CONTROL={settings.model_control} without NOGRAD_OPERATOR_API_KEYS: anyone "
        "who reaches the server's ports can load and unload models; set NOGRAD_OPERATOR_API_KEYS",
    )
    if settings.model_uploads and settings.model_control == "explicit":
        warnings += (
            "NOGRAD_MODEL_UPLOADS without NOGRAD_OPERATOR_API_KEYS: anyone who reaches the "
            "server's loopback ports can upload a model, and so run code of their choosing",
        )
    return warnings
