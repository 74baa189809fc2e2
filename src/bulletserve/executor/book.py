"""The request book: which requests wait and which run, and the KV blocks each holds. The engine
keeps its `Request`s in one and the simulator its `SimRequest`s, so admission, growth,
preemption, release and finishing are one implementation. Not thread-safe: the laned engine
calls it under its state lock."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

from bulletserve.kv.allocator import BlockAllocator
from bulletserve.sched.base import SeqView


class BookEntry(Protocol):
    """What the book needs of a request."""

    request_id: str
    num_computed_tokens: int
    block_table: list[int]
    num_preemptions: int

    @property
    def num_tokens(self) -> int: ...  # prompt plus output so far

    @property
    def num_output_tokens(self) -> int: ...

    def view(self) -> SeqView: ...  # the request as a policy sees it


E = TypeVar("E", bound=BookEntry)


class RequestBook(Generic[E]):
    """`waiting`: in queue order, preempted requests first. `running`: admitted and not finished,
    in admission order. `busy`: requests a step is computing now; their blocks are freed only
    when that step has ended (`release_blocks` skips them until then), so no kernel writes into
    memory handed to another request."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[E] = deque()
        self.running: list[E] = []
        self.busy: set[str] = set()
        self.num_preemptions = 0

    def take_waiting(self, request_ids: Iterable[str]) -> list[E]:
        """Take these requests out of the queue, in queue order."""
        ids = set(request_ids)
        taken = [r for r in self.waiting if r.request_id in ids]
        for request in taken:
            self.waiting.remove(request)
        return taken

    def admit(self, request_ids: tuple[str, ...]) -> list[E]:
        """Move these waiting requests to the running list, in the order given."""
        by_id = {r.request_id: r for r in self.take_waiting(request_ids)}
        admitted = [by_id[i] for i in request_ids]
        self.running.extend(admitted)
        return admitted

    def preempt(self, request_ids: Iterable[str]) -> list[E]:
        """Send these running requests back to the front of the queue, oldest first, their
        blocks freed and their KV to be recomputed."""
        ids = set(request_ids)
        preempted = [r for r in self.running if r.request_id in ids]
        for request in preempted:
            self.running.remove(request)
            self.release_blocks(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.extendleft(reversed(preempted))
        return preempted

    def grow_blocks(self, request: E, num_tokens: int) -> None:
        """Blocks for the request's first `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need > 0:
            request.block_table.extend(self.allocator.allocate(need))

    def release_blocks(self, request: E) -> None:
        """Free the request's blocks, unless a step is computing it (that step's end frees
        them)."""
        if request.block_table and request.request_id not in self.busy:
            self.allocator.free(request.block_table)
            request.block_table = []

    def finish(self, request: E) -> None:
        """Take the request out of whichever list holds it and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release_blocks(request)

    def waiting_views(self) -> tuple[SeqView, ...]:
        return tuple(r.view() for r in self.waiting)

    def running_views(self) -> tuple[SeqView, ...]:
        return tuple(r.view() for r in self.running)
