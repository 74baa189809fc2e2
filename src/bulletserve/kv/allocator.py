"""A thread-safe allocator of fixed-size KV blocks, shared by both lanes."""

from __future__ import annotations

import threading


class OutOfBlocksError(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


class BlockAllocator:
    """Hands out block ids 1..num_blocks; block 0 is the null block that padding points at.

    The most recently freed blocks go out first (a stack, lowest ids first at the start): the
    pool's memory is allocated untouched (on a CPU, pages are only backed once written), so a
    server touches no more of it than its peak use. Handed out oldest-freed first, a long run
    cycles through every block and backs the whole pool."""

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks, 0, -1))  # the top of the stack last
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
            return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(reversed(blocks))  # the first of them goes out first again
            if len(self._free) > self.num_blocks:
                raise RuntimeError("KV blocks freed twice")
