"""The request book: which requests wait and which run, and the KV blocks each holds. The engine
keeps its `Request`s in one and the simulator its `SimRequest`s, so admission, growth,
preemption, release and finishing are one implementation. Not thread-safe: the laned engine
calls it under its state lock."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

from bulletserve.kv.allocator import BlockAllocator, extend_prefix_keys
from bulletserve.sched.base import SeqView


class BookEntry(Protocol):
    """What the book needs of a request."""

    request_id: str
    num_computed_tokens: int
    block_table: list[int]
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    priority: int  # lower runs first (0 for every request under FCFS)

    @property
    def num_tokens(self) -> int: ...  # prompt plus output so far

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def num_draft_tokens(self) -> int: ...  # drafted tokens its next decode row verifies

    @property
    def skips_prefix_cache(self) -> bool: ...  # computes every prompt token (prompt logprobs)

    @property
    def prefix_root(self) -> int: ...  # its prefix keys' root: its cache salt's (0: none)

    def view(self) -> SeqView: ...  # the request as a policy sees it

    def token_ids(self, start: int, end: int) -> list[int]: ...  # tokens [start, end)


E = TypeVar("E", bound=BookEntry)


class RequestBook(Generic[E]):
    """`waiting`: in queue order (by priority, lower first; within one, preempted requests first,
    then by arrival). `running`: admitted and not finished,
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
        # Prefix caching (where the allocator does it): each request's prefix keys so far, and
        # how many of its blocks are cached (registered by it or shared from the cache).
        self._keys: dict[str, list[int]] = {}
        self._cached_blocks: dict[str, int] = {}
        # A waiting request's last lookup: the allocator's evictions then, and the blocks found.
        self._lookups: dict[str, tuple[int, list[int]]] = {}
        # Prompt tokens admitted and those of them found cached (vLLM's prefix-cache queries
        # and hits), over first admissions.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def enqueue(self, request: E) -> None:
        """A new request joins the queue behind every waiting request of its priority or a
        higher one (a lower value)."""
        if not self.waiting or self.waiting[-1].priority <= request.priority:
            self.waiting.append(request)  # every request alike under FCFS: no scan
        else:
            self._insert(request, behind_equals=True)

    def _insert(self, request: E, behind_equals: bool) -> None:
        """Into the queue before the first waiting request of a lower priority (a higher
        value), and with `behind_equals` False, before those of its own too."""
        place = next(
            (
                i
                for i, r in enumerate(self.waiting)
                if r.priority > request.priority
                or (not behind_equals and r.priority == request.priority)
            ),
            len(self.waiting),
        )
        self.waiting.insert(place, request)

    def overdue(self, now: float, limit_s: float) -> list[E]:
        """Waiting requests that no step has begun (never admitted, nothing computed) and that
        arrived more than `limit_s` before `now`."""
        return [
            r
            for r in self.waiting
            if not r.num_preemptions
            and not r.num_computed_tokens
            and now - r.view().arrival_time > limit_s
        ]

    def take_waiting(self, request_ids: Iterable[str]) -> list[E]:
        """Take these requests out of the queue, in queue order, each starting from the blocks of
        its longest cached prefix (shared, their tokens counted as computed)."""
        ids = set(request_ids)
        taken = [r for r in self.waiting if r.request_id in ids]
        for request in taken:
            self.waiting.remove(request)
        for request in taken:
            self._start_from_cache(request)
        return taken

    def admit(self, request_ids: tuple[str, ...]) -> list[E]:
        """Move these waiting requests to the running list, in the order given."""
        by_id = {r.request_id: r for r in self.take_waiting(request_ids)}
        admitted = [by_id[i] for i in request_ids]
        self.running.extend(admitted)
        return admitted

    def preempt(self, request_ids: Iterable[str]) -> list[E]:
        """Send these running requests back to the front of their priority's place in the
        queue, oldest first, their blocks freed and their KV to be recomputed."""
        ids = set(request_ids)
        preempted = [r for r in self.running if r.request_id in ids]
        for request in preempted:
            self.running.remove(request)
            self.release_blocks(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            self.num_preemptions += 1
        for request in reversed(preempted):
            self._insert(request, behind_equals=False)
        return preempted

    def grow_blocks(self, request: E, num_tokens: int) -> None:
        """Blocks for the request's first `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need > 0:
            request.block_table.extend(self.allocator.allocate(need))

    def trim_blocks(self, request: E, num_tokens: int) -> None:
        """Free the request's blocks past those its first `num_tokens` tokens fill (a
        verified row's rejected drafts: their KV is never read, and never cached)."""
        keep = -(-num_tokens // self.block_size)
        if len(request.block_table) > keep:
            self.allocator.free(request.block_table[keep:])
            del request.block_table[keep:]

    def release_blocks(self, request: E) -> None:
        """Free the request's blocks, unless a step is computing it (that step's end frees
        them); blocks that cache a prefix stay cached while the pool can keep them."""
        if request.block_table and request.request_id not in self.busy:
            self.allocator.free(request.block_table)
            request.block_table = []
            self._cached_blocks.pop(request.request_id, None)

    def finish(self, request: E) -> None:
        """Take the request out of whichever list holds it and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release_blocks(request)
        self._keys.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)

    def cache_computed(self, request: E) -> None:
        """After a step: cache the request's full blocks whose KV is now computed."""
        if not self.allocator.prefix_caching:
            return
        size = self.block_size
        full = min(request.num_computed_tokens // size, len(request.block_table))
        done = self._cached_blocks.get(request.request_id, 0)
        if full <= done:
            return
        keys = self._prefix_keys(request, full)
        for index in range(done, full):
            self.allocator.register(
                request.block_table[index],
                keys[index],
                keys[index - 1] if index else request.prefix_root,
                request.token_ids(index * size, (index + 1) * size),
                size,
            )
        self._cached_blocks[request.request_id] = full

    def waiting_views(self) -> tuple[SeqView, ...]:
        """The queue as a policy sees it: a request whose prefix is cached counts those tokens
        as computed, and as held only the cached blocks some other request holds (the others
        come out of the free count when it is admitted)."""
        if not self.allocator.prefix_caching:
            return tuple(r.view() for r in self.waiting)
        views = []
        for request in self.waiting:
            view = request.view()
            blocks = self._cached_prefix(request)
            if blocks:
                view = replace(
                    view,
                    num_computed_tokens=len(blocks) * self.block_size,
                    num_blocks=self.allocator.num_in_use(blocks),
                )
            views.append(view)
        return tuple(views)

    def running_views(self) -> tuple[SeqView, ...]:
        """The running requests as a policy sees them, with the blocks each shares."""
        views = tuple(r.view() for r in self.running)
        if not self.allocator.prefix_caching:
            return views
        if not self.allocator.any_shared:
            return views
        return tuple(
            replace(view, num_shared_blocks=shared) if shared else view
            for view, shared in zip(
                views,
                (self.allocator.num_shared(r.block_table) for r in self.running),
                strict=True,
            )
        )

    def _prefix_keys(self, request: E, num_blocks: int) -> list[int]:
        """The request's prefix keys, at least those of its first `num_blocks` blocks (kept and
        extended from step to step)."""
        keys = self._keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            size = self.block_size
            tokens = request.token_ids(len(keys) * size, num_blocks * size)
            extend_prefix_keys(keys, tokens, size, request.prefix_root)
        return keys

    def _cached_prefix(self, request: E) -> list[int]:
        """The cached blocks a waiting request would start from: full blocks of its tokens but
        the last (whose logits it needs), none if it holds blocks already or needs the logits
        of every prompt token."""
        if request.block_table or request.num_computed_tokens or request.skips_prefix_cache:
            return []
        size = self.block_size
        count = (request.num_tokens - 1) // size
        evictions = self.allocator.evictions
        memo = self._lookups.get(request.request_id)
        matched: list[int] = []
        if memo is not None and memo[0] == evictions:
            # Nothing evicted since: the blocks found then hold, and only a block cached since
            # right after them can extend them.
            matched = memo[1]
            keys = self._keys[request.request_id]
            if len(matched) == count or not self.allocator.is_cached(keys[len(matched)]):
                return matched
        matched = self.allocator.lookup(
            self._prefix_keys(request, count),
            count,
            lambda index: request.token_ids(index * size, (index + 1) * size),
            matched,
            request.prefix_root,
        )
        self._lookups[request.request_id] = (evictions, matched)
        return matched

    def _start_from_cache(self, request: E) -> None:
        if not self.allocator.prefix_caching:
            return
        blocks = self._cached_prefix(request)
        self._lookups.pop(request.request_id, None)
        first = request.num_preemptions == 0
        if first:
            prompt = request.num_tokens - request.num_output_tokens
            self.prefix_queries += prompt
            request.num_cached_tokens = min(len(blocks) * self.block_size, prompt)
            self.prefix_hits += request.num_cached_tokens
        if not blocks:
            return
        self.allocator.share(blocks)
        request.block_table = list(blocks)
        request.num_computed_tokens = len(blocks) * self.block_size
        self._cached_blocks[request.request_id] = len(blocks)
