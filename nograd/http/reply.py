"""An HTTP answer as nograd sends it, and a V2 inference answer encoded into one.

Both sides of a process boundary use these: the process that serves a call builds a ``Reply``;
an inference answer may instead leave the engine process unencoded (``ANSWER``), and the front
that holds the client's connection encodes it with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Send

from nograd.bridge.frames import ANSWER
from nograd.protocol import binary
from nograd.protocol import shared_memory as shm
from nograd.protocol.compression import compress, response_encoding
from nograd.protocol.limits import OFFLOAD_DECODE_BYTES
from nograd.protocol.v2_handover import Answer, encode_answer


@dataclass
class Reply:
    """A whole answer; sent as two ASGI messages, or as a Starlette ``Response`` by a route.
    With ``answer`` set it is a V2 answer left for the front to encode (``ANSWER``)."""

    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    answer: Answer | None = None

    async def send(self, send: Send) -> None:
        if self.answer is not None:
            await send({"type": ANSWER, "answer": self.answer.to_wire(), "headers": self.headers})
            return
        raw = [(b"content-length", str(len(self.body)).encode())]
        if self.content_type is not None:
            raw.append((b"content-type", self.content_type.encode("latin-1")))
        raw.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers)
        await send({"type": "http.response.start", "status": self.status, "headers": raw})
        await send({"type": "http.response.body", "body": self.body})

    def response(self) -> Response:
        return Response(
            self.body,
            status_code=self.status,
            headers=dict(self.headers),
            media_type=self.content_type,
        )


def answer_reply(answer: Answer, regions: shm.Regions | None = None) -> Reply:
    """JSON, or with any binary output JSON + raw bytes and ``Inference-Header-Content-Length``."""
    header, chunks = encode_answer(answer, regions)
    if not chunks:
        return Reply(200, header)
    return Reply(
        200,
        binary.join_body(header, chunks),
        binary.CONTENT_TYPE,
        [(binary.HEADER_LENGTH, str(len(header)))],
    )


async def encoded(reply: Reply, accept_encoding: str | None) -> Reply:
    """A successful reply compressed as a client's ``Accept-Encoding`` asks (gzip or deflate),
    a large one in a thread; otherwise as it is."""
    encoding = reply_encoding(reply, accept_encoding)
    if encoding is None:
        return reply
    if len(reply.body) > OFFLOAD_DECODE_BYTES:
        return await run_in_threadpool(compress_reply, reply, encoding)
    return compress_reply(reply, encoding)


def reply_encoding(reply: Reply, accept_encoding: str | None) -> str | None:
    """The encoding a successful reply is compressed with for a client's ``Accept-Encoding``
    (gzip or deflate), or None: sent as it is."""
    if reply.status != 200:
        return None
    return response_encoding(accept_encoding)


def compress_reply(reply: Reply, encoding: str) -> Reply:
    reply.body = compress(reply.body, encoding)
    reply.headers += [("Content-Encoding", encoding), ("Vary", "Accept-Encoding")]
    return reply
