"""A thread-safe allocator of fixed-size KV blocks, shared by both lanes."""

from __future__ import annotations

import threading
from collections import deque


class OutOfBlocksError(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


class BlockAllocator:
    """Hands out block ids 1..num_blocks; block 0 is the null block that padding points at."""

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks + 1))
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, all or none."""
        with self._lock:
            if count > len(self._free):
                raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free")
            return [self._free.popleft() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(blocks)
            if len(self._free) > self.num_blocks:
                raise RuntimeError("KV blocks freed twice")
