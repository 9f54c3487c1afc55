"""A call's key as the serving core files a caller's state under it: one id per key, the same
whatever the scheme's case or the spaces around the token, never the key itself."""

from __future__ import annotations

from nograd.protocol.keys import bearer_key_matches, key_id


def test_a_key_id_names_its_key_and_never_shows_it() -> None:
    alice = key_id(["Bearer alice-key"])
    assert alice == key_id([b"bearer  alice-key "])
    assert alice != key_id(["Bearer bob-key"])
    assert "alice" not in alice and len(alice) == 32
    # No key, several values or another scheme: the one id of "no token", which no key matches.
    assert key_id([]) == key_id(["Bearer a", "Bearer b"]) == key_id(["Basic alice-key"])
    assert not bearer_key_matches(["Basic alice-key"], [b"alice-key"])
    assert bearer_key_matches(["Bearer alice-key"], [b"bob-key", b"alice-key"])
