"""Triton's streaming inference RPC (``ModelStreamInfer``): the requests of one stream served side
by side, each answered (or its error sent in the stream) as soon as it is ready, a decoupled
model's 0..n responses each as it comes. ``InferenceService`` takes it from here.

What a stream holds for a client that takes no answers is bounded: at most ``MAX_SERVED`` of
its requests are served at once (the next ones wait in the stream's backlog), their answers wait
for the stream in a queue of ``MAX_QUEUED_ANSWERS``, and a decoupled model's responses to one
request in a queue of ``NOGRAD_MAX_QUEUED_RESPONSES`` (the model's sender waits while it is
full), so a stalled stream stops the work it asks for.

A sequence's requests keep the order they came in on the stream: each takes its place among its
sequence's requests as the stream reads it, before anything is awaited, so a large request
decoded in a thread is not overtaken by a small one of the same sequence sent after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from nograd.core.responses import ResponseQueue
from nograd.grpc.failures import client_message
from nograd.grpc.generated import grpc_service_pb2 as pb
from nograd.grpc.rpc import CallContext
from nograd.grpc.tensors import encode_outputs, sequence_parameters
from nograd.grpc.versions import requested_version
from nograd.serving.calls import Call, Calls
from nograd.serving.dataplane import DataPlane
from nograd.serving.errors import Kind, kind_of
from nograd.serving.sequences import Place, sequence_request

PROTOCOL = "grpc"
TARGET = "/inference.GRPCInferenceService/ModelStreamInfer"
MAX_SERVED: Final = 64
"""Requests of one stream served at once (answered or not yet sent); the next wait their turn."""
MAX_QUEUED_ANSWERS: Final = 16
"""Answers of one stream ready and waiting for the stream to take them."""


class StreamInferRpcs:
    """``ModelStreamInfer``, over the service's own authorization, abort and inference."""

    _calls: Calls
    _plane: DataPlane
    _infer: Callable[..., Awaitable[pb.ModelInferResponse]]
    """One inference request (call, request, context, responder, place)."""
    _max_queued_responses: int
    """A decoupled model's responses to one request waiting to be sent, at most."""

    def authorize(self, context: CallContext, model: str | None = None) -> None:
        raise NotImplementedError

    async def _abort(self, context: CallContext, exc: BaseException, kind: Kind) -> None:
        raise NotImplementedError

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: CallContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request of the stream served as ModelInfer serves it, side by side, its answer
        (or its error, in ``error_message`` as Triton sends it, the stream going on) sent as
        soon as it is ready."""
        try:
            self.authorize(context)
        except Exception as exc:
            await self._abort(context, exc, kind_of(exc))
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(
            MAX_QUEUED_ANSWERS
        )
        serving: set[asyncio.Task[None]] = set()
        room = asyncio.Semaphore(MAX_SERVED)

        def given_back(task: asyncio.Task[None]) -> None:
            del task
            room.release()

        async def serve(request: Any, place: Place | None) -> None:
            call = self._calls.open(PROTOCOL, TARGET)
            if not self._decoupled(call, request):
                await answers.put(await self._stream_one(call, request, context, place))
                return
            async for answer in self._stream_decoupled(call, request, context, place):
                await answers.put(answer)

        async def take() -> None:
            async for request in requests:
                await room.acquire()
                place = self._place(request)
                task = asyncio.create_task(serve(request, place))
                serving.add(task)
                task.add_done_callback(serving.discard)
                task.add_done_callback(given_back)
                if place is not None:  # given up however the task ends, even cancelled unstarted
                    task.add_done_callback(place.left_with)
            await asyncio.gather(*serving)
            await answers.put(None)

        taking = asyncio.create_task(take())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            taking.cancel()
            for task in list(serving):
                task.cancel()

    def _place(self, request: Any) -> Place | None:
        """The request's place among its sequence's requests, taken as the stream reads it;
        None when it names none (a request refused here is refused again when served)."""
        try:
            sequence = sequence_request(sequence_parameters(request))
            if not sequence.id:
                return None  # the model is looked up once, when the request is served
            model = self._plane.get(request.model_name, requested_version(request.model_version))
        except Exception:
            return None
        return self._calls.sequences.take_place(model, sequence)

    def _decoupled(self, call: Call, request: Any) -> bool:
        """Whether the request's model answers 0..n responses; the version found is the one
        ``call`` serves (``Calls.served``)."""
        try:
            name, version = request.model_name, requested_version(request.model_version)
            model = self._calls.served(call, name, version)
        except Exception:
            return False  # refused as ModelInfer refuses it
        return model.config.decoupled

    async def _stream_decoupled(
        self, call: Call, request: Any, context: CallContext, place: Place | None
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A decoupled model's 0..n responses to one request, each sent as it comes; with
        Triton's ``triton_enable_empty_final_response``, each says whether it is the last and
        the final flag without a response is sent too."""
        calls = self._calls
        call.model = calls.label(request.model_name)
        flagged = request.parameters.get("triton_enable_empty_final_response")
        mark_final = flagged is not None and flagged.bool_param
        responder = ResponseQueue(asyncio.get_running_loop(), self._max_queued_responses)
        kind: Kind | None = Kind.CLIENT_GONE
        try:
            head = await self._infer(call, request, context, responder, place)
            async for response in responder.responses():
                if response.error is not None:
                    yield pb.ModelStreamInferResponse(
                        error_message=client_message(response.error, kind_of(response.error))
                    )
                    continue
                if response.outputs is None and not mark_final:
                    continue
                answer = pb.ModelInferResponse()
                answer.CopyFrom(head)
                if response.outputs is not None:
                    encode_outputs(answer, dict(response.outputs), request.outputs)
                if mark_final:
                    answer.parameters["triton_final_response"].bool_param = response.final
                yield pb.ModelStreamInferResponse(infer_response=answer)
            kind = None
        except Exception as exc:
            kind = calls.failed(call, exc)
            yield pb.ModelStreamInferResponse(error_message=client_message(exc, kind))
        finally:
            responder.end()  # a model still sending goes on, its responses dropped
            calls.close(call, 200 if kind is None else kind.status)

    async def _stream_one(
        self, call: Call, request: Any, context: CallContext, place: Place | None
    ) -> pb.ModelStreamInferResponse:
        calls = self._calls
        call.model = calls.label(request.model_name)
        kind: Kind | None = Kind.CLIENT_GONE
        try:
            response = await self._infer(call, request, context, place=place)
            kind = None
            return pb.ModelStreamInferResponse(infer_response=response)
        except Exception as exc:
            kind = calls.failed(call, exc)
            return pb.ModelStreamInferResponse(error_message=client_message(exc, kind))
        finally:
            calls.close(call, 200 if kind is None else kind.status)
