"""Content codings of inference bodies: inflation piece by piece, its refusals, and the coding an
``Accept-Encoding`` header picks."""

from __future__ import annotations

import gzip
import zlib

import pytest

from nograd.core.errors import DecodeError
from nograd.protocol.compression import (
    PIECE_BYTES,
    Inflater,
    compress,
    request_encoding,
    response_encoding,
)


def _inflate(body: bytes, encoding: str) -> tuple[bytes, int]:
    inflater = Inflater(body, encoding)
    pieces = []
    while not inflater.done:
        pieces.append(inflater.step())
        assert len(pieces[-1]) <= PIECE_BYTES
    return b"".join(pieces), len(pieces)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_inflates_in_bounded_pieces_and_round_trips(encoding: str) -> None:
    text = bytes(3 * PIECE_BYTES + 17)
    inflated, steps = _inflate(compress(text, encoding), encoding)
    assert inflated == text
    assert steps >= 4


def test_tritonclient_codings_are_read() -> None:
    text = b'{"inputs": []}'
    assert _inflate(gzip.compress(text), "gzip")[0] == text
    assert _inflate(zlib.compress(text), "deflate")[0] == text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (gzip.compress(b"x" * 1000, mtime=0)[:-12], "cut short"),
        (gzip.compress(b"x", mtime=0) + b"junk", "after the end"),
        (b"not gzip at all", "not valid gzip"),
        (b"", "cut short"),
    ],
    # Named, not by their bytes: each test process collects the same ids.
    ids=["truncated", "trailing junk", "not gzip", "empty"],
)
def test_a_broken_body_is_refused_by_name(body: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        _inflate(body, "gzip")


def test_request_encodings() -> None:
    assert request_encoding(None) is None
    assert request_encoding(" Identity ") is None
    assert request_encoding("GZIP") == "gzip"
    with pytest.raises(DecodeError, match="'br' is not supported; send gzip, deflate"):
        request_encoding("br")


@pytest.mark.parametrize(
    ("header", "chosen"),
    [
        (None, None),
        ("", None),
        ("identity", None),
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("deflate, gzip", "gzip"),
        ("gzip;q=0.2, deflate;q=0.9", "deflate"),
        ("gzip;q=0", None),
        ("*", "gzip"),
        ("br, *;q=0.1", "gzip"),
        ("gzip;q=nonsense, deflate", "deflate"),
    ],
)
def test_the_answer_coding_follows_accept_encoding(header: str | None, chosen: str | None) -> None:
    assert response_encoding(header) == chosen
