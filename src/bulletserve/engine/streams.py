"""The open request streams of an engine client (`AsyncEngine`, `CoreProcess`): each an asyncio
queue on the event loop that opened it, fed from the engine's side (another thread) with one
wake-up per loop and step, and read by `stream_outputs`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from bulletserve.engine.request import RequestOutput


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class StreamRegistry:
    """Request id -> its stream (thread-safe)."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str) -> asyncio.Queue:
        """A stream for the request on the running event loop; ValueError if it has one."""
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
        return stream.queue

    def close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._streams

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def end_all(self, error: BaseException) -> None:
        """Put `error` in every open stream. Called on the event loop the streams are on."""
        with self._lock:
            queues = [stream.queue for stream in self._streams.values()]
        for queue in queues:
            queue.put_nowait(error)

    def hand_over(self, items: list[tuple[str, object]]) -> list[threading.Event]:
        """Put each (request id, output or exception) in its stream from any thread, with one
        wake-up per event loop; items of closed streams are dropped. Returns, per loop, an
        event set once the loop has run every task the items woke up to its next wait (for a
        stream's task: until it has written its chunk)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, item))
        handed = []
        for loop, batch in batches.items():
            done = threading.Event()
            try:
                loop.call_soon_threadsafe(_put_all, batch, done)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                continue
            handed.append(done)
        return handed


def _put_all(batch: list[tuple[asyncio.Queue, object]], done: threading.Event) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
    # The ready queue is FIFO: `done` is set after every task these puts woke has run up to
    # its next wait.
    asyncio.get_running_loop().call_soon(done.set)


async def stream_outputs(queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its stream's queue until the finished one; an exception in the
    queue is raised in its turn. Outputs that queued up while the event loop was busy go out as
    one (`RequestOutput.then`): a stream that falls behind the engine catches up in one chunk
    instead of writing every step's."""
    pending: BaseException | None = None
    while pending is None:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        while not item.finished and not queue.empty():
            later = queue.get_nowait()
            if isinstance(later, BaseException):
                pending = later
                break
            item = item.then(later)
        yield item
        if item.finished:
            return
    raise pending
