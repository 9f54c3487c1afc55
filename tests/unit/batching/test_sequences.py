"""The sequence book on its own: order within a sequence, concurrency across sequences, start,
end, idle release and its bound, on a clock the tests move."""

from __future__ import annotations

import asyncio

import pytest

from nograd.batching.sequences import Sequence, SequenceBook, TooManySequences, UnknownSequence


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def adder(value: int) -> object:
    async def work(sequence: Sequence) -> int:
        sequence.state["sum"] = sequence.state.get("sum", 0) + value
        return int(sequence.state["sum"])

    return work


async def test_each_sequence_keeps_its_own_state() -> None:
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    assert await book.run(1, True, False, adder(10)) == 10
    assert await book.run("a", True, False, adder(100)) == 100
    assert await book.run(1, False, False, adder(5)) == 15
    assert await book.run("a", False, True, adder(1)) == 101
    assert "a" not in book and 1 in book


async def test_a_sequence_must_start_and_its_end_releases_it() -> None:
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    with pytest.raises(UnknownSequence):
        await book.run(7, False, False, adder(1))
    await book.run(7, True, True, adder(1))
    with pytest.raises(UnknownSequence):
        await book.run(7, False, False, adder(1))
    assert await book.run(7, True, False, adder(3)) == 3  # the id starts afresh


async def test_start_again_begins_a_fresh_state() -> None:
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    await book.run(1, True, False, adder(10))
    assert await book.run(1, True, False, adder(2)) == 2


async def test_an_int_and_a_string_id_are_different_sequences() -> None:
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    await book.run(1000, True, False, adder(1))
    with pytest.raises(UnknownSequence):
        await book.run("1000", False, False, adder(1))


async def test_idle_sequences_are_released_but_not_busy_ones() -> None:
    clock = Clock()
    book = SequenceBook(idle_s=1.0, max_sequences=4, clock=clock)
    await book.run(1, True, False, adder(1))
    gate = asyncio.Event()

    async def slow(sequence: Sequence) -> int:
        await gate.wait()
        return 0

    await book.run(2, True, False, adder(1))
    running = asyncio.create_task(book.run(2, False, False, slow))
    await asyncio.sleep(0)
    clock.now = 2.0
    assert book.release_idle() == 1  # sequence 1; sequence 2 waits on its model
    assert 1 not in book and 2 in book
    gate.set()
    await running
    clock.now = 2.5
    assert 2 in book
    clock.now = 3.6
    assert 2 not in book
    with pytest.raises(UnknownSequence):
        await book.run(2, False, False, adder(1))


async def test_requests_of_one_sequence_run_in_order_others_alongside() -> None:
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    log: list[str] = []
    release = asyncio.Event()

    def step(name: str, wait: bool) -> object:
        async def work(sequence: Sequence) -> None:
            log.append(f"{name} begins")
            if wait:
                await release.wait()
            log.append(f"{name} ends")

        return work

    await book.run(1, True, False, step("start", False))
    first = asyncio.create_task(book.run(1, False, False, step("a1", True)))
    second = asyncio.create_task(book.run(1, False, False, step("a2", False)))
    await asyncio.sleep(0.01)
    await book.run(2, True, False, step("b", False))  # another sequence is not held up
    assert log[2:] == ["a1 begins", "b begins", "b ends"]
    release.set()
    await asyncio.gather(first, second)
    assert log[5:] == ["a1 ends", "a2 begins", "a2 ends"]


async def test_sequences_beyond_the_bound_are_shed_until_one_is_released() -> None:
    clock = Clock()
    book = SequenceBook(idle_s=1.0, max_sequences=2, clock=clock)
    await book.run(1, True, False, adder(1))
    await book.run(2, True, False, adder(1))
    with pytest.raises(TooManySequences) as shed:
        await book.run(3, True, False, adder(1))
    assert shed.value.retry_after_s == 1.0
    await book.run(1, True, False, adder(1))  # restarting one under way takes no new place
    clock.now = 1.5
    assert await book.run(3, True, False, adder(4)) == 4


async def test_a_failed_request_keeps_its_sequence() -> None:
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    await book.run(1, True, False, adder(1))

    async def boom(sequence: Sequence) -> int:
        raise RuntimeError("model failed")

    with pytest.raises(RuntimeError):
        await book.run(1, False, False, boom)
    assert await book.run(1, False, False, adder(2)) == 3


async def test_places_taken_on_arrival_fix_the_order_of_a_sequence_s_requests() -> None:
    """The START's place is taken first: the request after it, though it reaches ``run``
    first, waits for the START to reach its sequence rather than finding none started."""
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    first, second = book.take_place(9), book.take_place(9)
    later = asyncio.create_task(book.run(9, False, False, adder(2), second))
    await asyncio.sleep(0)
    assert not later.done()  # waits behind the START's place
    assert await book.run(9, True, False, adder(5), first) == 5
    assert await later == 7


async def test_a_place_given_up_lets_the_next_one_go_on() -> None:
    """A request that fails before it reaches its sequence (a decoding error) leaves its place;
    the next goes on, and a place of another sequence never waits."""
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    await book.run(3, True, False, adder(1))
    failed, after = book.take_place(3), book.take_place(3)
    other = book.take_place(4)
    assert await book.run(4, True, True, adder(8), other) == 8
    waiting = asyncio.create_task(book.run(3, False, False, adder(2), after))
    await asyncio.sleep(0)
    assert not waiting.done()
    failed.leave()
    failed.leave()  # idempotent
    assert await waiting == 3
    assert not book._places  # every place given back


async def test_a_place_whose_task_is_cancelled_before_it_ran_is_given_back() -> None:
    """A stream ending cancels requests it has not started: their places must not hold the
    sequence's later requests forever."""
    book = SequenceBook(idle_s=5.0, max_sequences=4)
    cancelled, after = book.take_place(5), book.take_place(5)
    task = asyncio.create_task(book.run(5, True, False, adder(1), cancelled))
    task.add_done_callback(cancelled.left_with)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await asyncio.wait_for(book.run(5, True, False, adder(2), after), 5) == 2
