"""A decoupled model's responses to one request wait in a bounded queue: the model's sender
(its own thread) waits while the queue is full and goes on as the front takes responses; once
the call ends, a sender waiting (or sending later) goes on at once, its responses dropped."""

from __future__ import annotations

import asyncio
import threading

from nograd.core.responses import Response, ResponseQueue

SENDS = 1000


def sender(queue: ResponseQueue, sent: list[int]) -> threading.Thread:
    """A model thread sending ``SENDS`` responses, the last one final."""

    def send() -> None:
        for index in range(SENDS):
            queue.put(Response({"index": index}, None, index == SENDS - 1))
            sent[0] += 1

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


async def test_a_full_queue_holds_the_sender_until_responses_are_taken() -> None:
    queue = ResponseQueue(asyncio.get_running_loop(), max_size=4)
    sent = [0]
    thread = sender(queue, sent)
    await asyncio.sleep(0.3)
    assert queue.queued == 4 and sent[0] <= 5  # before, all 1000 were queued at once
    assert thread.is_alive()
    taken = [response.outputs["index"] async for response in queue.responses() if response.outputs]
    assert taken == list(range(SENDS))
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive()


async def test_an_ended_call_lets_its_sender_go_on() -> None:
    queue = ResponseQueue(asyncio.get_running_loop(), max_size=4)
    sent = [0]
    thread = sender(queue, sent)
    responses = queue.responses()
    first = await anext(responses)
    assert first.outputs == {"index": 0}
    await responses.aclose()  # the client went away: the queue ends with the iteration
    await asyncio.to_thread(thread.join, 5)
    assert not thread.is_alive() and sent[0] == SENDS and queue.queued == 0
