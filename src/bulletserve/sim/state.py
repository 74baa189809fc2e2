"""Bookkeeping shared by both executors: queues, KV blocks, tokens, finishing, the step log.

Each method mirrors the engine's method of the same role (`LLMEngine._apply_preemptions`,
`_grow_blocks`, `_append_token`, `_finish`), with simulated time for the wall clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import TextIO

from bulletserve.executor.record import StepRecord, write_step
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
    ) -> None:
        self.requests = list(requests)
        self._pending = deque(sorted(self.requests, key=lambda r: (r.arrival, r.index)))
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_preemptions = 0
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
            self.waiting.append(request)
        return arrived

    @property
    def unfinished(self) -> bool:
        return bool(self._pending or self.waiting or self.running)

    # ---- the engine's bookkeeping -------------------------------------------------------------

    def apply_preemptions(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        if not ids:
            return
        preempted = [r for r in self.running if r.request_id in ids]
        for request in preempted:
            self.running.remove(request)
            self.release_blocks(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.extendleft(reversed(preempted))

    def grow_blocks(self, request: SimRequest, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(request.blocks)
        if need > 0:
            request.blocks.extend(self.allocator.allocate(need))

    def release_blocks(self, request: SimRequest) -> None:
        if request.blocks:
            self.allocator.free(request.blocks)
            request.blocks = []

    def append_token(self, request: SimRequest, now: float) -> bool:
        """Record a sampled token; finish the request when it has all its output (the bench
        asks for exactly its output length) or fills the context. True if it finished."""
        request.add_token(now)
        if len(request.token_times) >= request.output_len or request.num_tokens >= (
            self.max_model_len
        ):
            self.finish(request, now)
            return True
        return False

    def finish(self, request: SimRequest, now: float) -> None:
        request.finished_at = now
        if request in self.running:
            self.running.remove(request)
        self.release_blocks(request)

    def fail_unfinished(self, reason: str) -> None:
        """End a run that cannot progress: every request still queued or running fails."""
        for request in [*self.waiting, *self.running, *self._pending]:
            request.error = reason
            self.release_blocks(request)
        self.waiting.clear()
        self.running.clear()
        self._pending.clear()

    def log_step(self, record: StepRecord) -> None:
        self.num_steps += 1
        if self.step_log is not None:
            write_step(self.step_log, record)
