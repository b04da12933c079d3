"""``until_stopped``: a stream ends with where to resume when the server drains, whether it is
waiting for an event or busy delivering one, and a client's cancellation stays a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from contextsvc.api.gate import ServerShuttingDown
from contextsvc.api.streams import until_stopped


@dataclass(frozen=True)
class Ev:
    event_id: int


class Feed:
    """Events put by the test; ``closed`` records that the stream closed its source."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Ev | None] = asyncio.Queue()
        self.closed = False

    async def events(self) -> AsyncIterator[Ev]:
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                yield item
        finally:
            self.closed = True


async def _collect(stream: AsyncIterator[Ev], into: list[int], on_each: asyncio.Event | None = None) -> None:
    async for ev in stream:
        into.append(ev.event_id)
        if on_each is not None:
            on_each.set()


def test_waiting_stream_ends_with_last_delivered_id_when_stop_is_set() -> None:
    async def main() -> None:
        feed, stop, got = Feed(), asyncio.Event(), []
        for i in (11, 12):
            feed.queue.put_nowait(Ev(i))
        consumer = asyncio.create_task(_collect(until_stopped(feed.events(), stop, after_event_id=5), got))
        for _ in range(20):
            await asyncio.sleep(0)
        assert got == [11, 12]  # now waiting for a third
        stop.set()
        with pytest.raises(ServerShuttingDown) as caught:
            await asyncio.wait_for(consumer, 2)
        assert caught.value.metadata == {"after_event_id": "12"}
        assert feed.closed

    asyncio.run(main())


def test_nothing_delivered_names_the_id_the_client_resumed_from() -> None:
    async def main() -> None:
        feed, stop, got = Feed(), asyncio.Event(), []
        consumer = asyncio.create_task(_collect(until_stopped(feed.events(), stop, after_event_id=7), got))
        await asyncio.sleep(0.01)
        stop.set()
        with pytest.raises(ServerShuttingDown) as caught:
            await asyncio.wait_for(consumer, 2)
        assert got == [] and caught.value.metadata == {"after_event_id": "7"}

    asyncio.run(main())


def test_stop_while_busy_delivers_what_is_ready_then_ends() -> None:
    async def main() -> None:
        feed, stop = Feed(), asyncio.Event()
        feed.queue.put_nowait(Ev(1))
        stream = until_stopped(feed.events(), stop, after_event_id=0)
        first = await anext(stream)
        # The consumer is busy with event 1 (not waiting) when the drain starts; two more are ready.
        stop.set()
        feed.queue.put_nowait(Ev(2))
        feed.queue.put_nowait(Ev(3))
        await asyncio.sleep(0)
        rest = [await anext(stream), await anext(stream)]
        with pytest.raises(ServerShuttingDown) as caught:
            await anext(stream)
        assert [first.event_id, *(e.event_id for e in rest)] == [1, 2, 3]
        assert caught.value.metadata == {"after_event_id": "3"}

    asyncio.run(main())


def test_source_that_ends_ends_the_stream_normally_even_while_draining() -> None:
    async def main() -> None:
        feed, stop, got = Feed(), asyncio.Event(), []
        feed.queue.put_nowait(Ev(1))
        feed.queue.put_nowait(None)
        await _collect(until_stopped(feed.events(), stop, after_event_id=0), got)
        assert got == [1]
        feed2, got2 = Feed(), []
        feed2.queue.put_nowait(None)
        stop.set()
        await _collect(until_stopped(feed2.events(), stop, after_event_id=0), got2)
        assert got2 == [] and feed2.closed

    asyncio.run(main())


def test_client_cancellation_is_not_turned_into_shutting_down() -> None:
    async def main() -> None:
        for also_stop in (False, True):
            feed, stop, got = Feed(), asyncio.Event(), []
            consumer = asyncio.create_task(_collect(until_stopped(feed.events(), stop, after_event_id=0), got))
            await asyncio.sleep(0.01)
            consumer.cancel()  # the client went away (grpc cancels the handler's task)
            if also_stop:  # and the drain starts in the same loop pass
                stop.set()
            with pytest.raises(asyncio.CancelledError):
                await consumer
            assert feed.closed

    asyncio.run(main())
