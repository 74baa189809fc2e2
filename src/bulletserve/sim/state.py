"""What the simulated engine holds: the requests still to arrive, the request book (queues and
KV blocks, `executor.book`, the engine's own), tokens and finishing on simulated time, and the
step log."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TextIO

from bulletserve.bookkeeping.book import RequestBook
from bulletserve.bookkeeping.record import StepRecord, write_step
from bulletserve.kv.allocator import BlockAllocator
from bulletserve.sim.request import SimRequest


class SimState:
    def __init__(
        self,
        requests: Sequence[SimRequest],
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        step_log: TextIO | None = None,
        prefix_caching: bool = True,
        max_queue_delay_s: float | None = None,
    ) -> None:
        self.requests = list(requests)
        self._pending = deque(sorted(self.requests, key=lambda r: (r.arrival, r.index)))
        allocator = BlockAllocator(num_blocks, prefix_caching)
        self.book: RequestBook[SimRequest] = RequestBook(allocator, block_size)
        self.max_model_len = max_model_len
        self.max_queue_delay_s = max_queue_delay_s
        self.num_steps = 0
        self.step_log = step_log

    # ---- arrivals ---------------------------------------------------------------------------

    def next_arrival(self) -> float | None:
        return self._pending[0].arrival if self._pending else None

    def drain(self, now: float) -> bool:
        """Queue every request that has arrived by `now` (the engine's inbox); True if any did.
        A prompt the engine would refuse fails here, as the server's 400 fails it in the bench."""
        arrived = False
        while self._pending and self._pending[0].arrival <= now:
            request = self._pending.popleft()
            arrived = True
            if request.input_len >= self.max_model_len:
                request.error = (
                    f"the prompt has {request.input_len} tokens; --max-model-len is "
                    f"{self.max_model_len}, which leaves no room for output"
                )
                continue
            self.book.enqueue(request)
        if self.max_queue_delay_s is not None:  # as the engine's RequestLife.take_in
            for request in self.book.overdue(now, self.max_queue_delay_s):
                request.error = "shed: waited past --max-queue-delay-ms for its first step"
                self.book.finish(request)
        return arrived

    @property
    def unfinished(self) -> bool:
        return bool(self._pending or self.book.waiting or self.book.running)

    # ---- tokens and finishing -----------------------------------------------------------------

    def append_token(self, request: SimRequest, now: float) -> bool:
        """Record a sampled token; finish the request when it has all its output (the bench
        asks for exactly its output length) or fills the context. True if it finished."""
        request.add_token(now)
        if len(request.token_times) >= request.output_len or request.num_tokens >= (
            self.max_model_len
        ):
            request.finished_at = now
            self.book.finish(request)
            return True
        return False

    def fail_unfinished(self, reason: str) -> None:
        """End a run that cannot progress: every request still queued or running fails."""
        book = self.book
        for request in [*book.waiting, *book.running, *self._pending]:
            request.error = reason
            book.release_blocks(request)
        book.waiting.clear()
        book.running.clear()
        self._pending.clear()

    def log_step(self, record: StepRecord) -> None:
        self.num_steps += 1
        if self.step_log is not None:
            write_step(self.step_log, record)
