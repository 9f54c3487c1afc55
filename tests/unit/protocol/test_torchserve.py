"""A TorchServe request decoded into the handler's dict and headers as TorchServe's frontend and
worker make them: each input's content type decides its value and is its own header."""

from __future__ import annotations

import pytest

from nograd.core.errors import DecodeError
from nograd.protocol.torchserve import handler_request

FORM = "multipart/form-data; boundary=b"


def _form(*parts: str) -> bytes:
    return ("".join(f"--b\r\n{part}\r\n" for part in parts) + "--b--\r\n").encode()


def test_a_file_part_without_a_type_is_octet_stream_and_a_field_has_none() -> None:
    body = _form(
        'Content-Disposition: form-data; name="f"; filename="a.json"\r\n\r\n{"a": 1}',
        'Content-Disposition: form-data; name="j"; filename="j.json"\r\n'
        'Content-Type: application/json; charset=utf-8\r\n\r\n{"a": 1}',
        'Content-Disposition: form-data; name="t"\r\nContent-Type: text/plain\r\n\r\nhi',
    )
    request = handler_request(body, {"content-type": FORM})
    assert request.data == {"f": bytearray(b'{"a": 1}'), "j": {"a": 1}, "t": bytearray(b"hi")}
    assert request.headers == {
        "f": {"content-type": "application/octet-stream"},
        "j": {"content-type": "application/json"},
        "t": {"content-type": ""},
        "content-type": FORM,
        "url_path": "",
        "explain": "False",
    }


def test_urlencoded_fields_are_bytes() -> None:
    request = handler_request(
        b"a=%C3%A9+x&b=", {"content-type": "application/x-www-form-urlencoded", "x-trace": "1"}
    )
    assert request.data == {"a": bytearray("é x".encode()), "b": b""}
    assert request.headers["a"] == request.headers["b"] == {"content-type": ""}
    assert request.headers["x-trace"] == "1"


@pytest.mark.parametrize(
    ("content_type", "value"),
    [
        ("application/json", {"a": 1}),
        ("Application/JSON", bytearray(b'{"a": 1}')),
        ("text/csv; charset=utf-8", '{"a": 1}'),
        ("", bytearray(b'{"a": 1}')),
    ],
)
def test_a_raw_body_is_decoded_by_its_media_type_exactly(content_type: str, value: object) -> None:
    headers = {"content-type": content_type} if content_type else {}
    request = handler_request(b'{"a": 1}', headers)
    assert request.data == {"body": value}
    assert request.headers["body"] == {"content-type": content_type.split(";")[0]}


def test_request_headers_win_over_inputs_and_the_frontends_over_the_clients() -> None:
    request = handler_request(b"x", {"body": "sent", "explain": "True", "url_path": "p"})
    assert request.headers["body"] == "sent"
    assert (request.headers["explain"], request.headers["url_path"]) == ("False", "")


def test_a_form_without_parts_is_refused() -> None:
    with pytest.raises(DecodeError, match="no parts"):
        handler_request(b"nothing", {"content-type": FORM})
