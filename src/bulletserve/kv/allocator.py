"""A thread-safe allocator of fixed-size KV blocks, shared by both lanes, with prefix caching.

A block is free, in use (held by one or more requests: its reference count), or cached: held by
no request but keeping the KV of a full block of tokens, found again by its key (the hash of its
tokens and of the prefix before them; `extend_prefix_keys`). Cached blocks count as free: an
allocation that finds too few free blocks evicts the least recently released cached ones.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


def extend_prefix_keys(
    keys: list[int], tokens: Sequence[int], block_size: int, root: int = 0
) -> list[int]:
    """Extend `keys`, the prefix keys of a sequence's first len(keys) full blocks, with those of
    the full blocks of `tokens`, the tokens that follow them: key i hashes block i's tokens and
    key i - 1 (`root` before the first: 0, or a cache salt's `salt_root`). Python's hash of a
    tuple of ints is the same in every process; a collision is caught by comparing tokens on
    lookup (`BlockAllocator.lookup`)."""
    parent = keys[-1] if keys else root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


def salt_root(salt: str | None) -> int:
    """The root of the prefix keys of requests with this cache salt (vLLM's `cache_salt`): only
    requests with the same salt share cached blocks. 0 for none; else a hash that is the same
    in every process (Python's hash of a string is not)."""
    if salt is None:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") or 1


@dataclass(frozen=True)
class _Cached:
    key: int
    parent: int
    tokens: tuple[int, ...]


class BlockAllocator:
    """Hands out block ids 1..num_blocks; block 0 is the null block that padding points at.

    The most recently freed blocks go out first (a stack, lowest ids first at the start): the
    pool's memory is allocated untouched (on a CPU, pages are only backed once written), so a
    server touches no more of it than its peak use. Handed out oldest-freed first, a long run
    cycles through every block and backs the whole pool.

    With `prefix_caching`, a full block whose KV a request computed can be `register`ed under its
    key; `lookup` finds the cached blocks of a prefix and `share` takes a reference to them."""

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks, 0, -1))  # the top of the stack last
        self._refs = [0] * (num_blocks + 1)
        self._by_key: dict[int, int] = {}
        self._cached: dict[int, _Cached] = {}  # block -> what it caches
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self._shared: set[int] = set()  # blocks more than one request holds
        # Bumped at every eviction: a lookup's blocks stay cached until it changes.
        self.evictions = 0
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a cached prefix (in use or not)."""
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, all or none; cached blocks no request holds are evicted (least
        recently released first) when too few are free."""
        with self._lock:
            if count > self.num_free:
                raise OutOfBlocksError(f"asked for {count} KV blocks, {self.num_free} free")
            blocks = []
            for _ in range(count):
                if self._free:
                    block = self._free.pop()
                else:
                    block, _ = self._evictable.popitem(last=False)
                    del self._by_key[self._cached.pop(block).key]
                    self.evictions += 1
                self._refs[block] = 1
                blocks.append(block)
            return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block no request holds any more is free again,
        or, if it caches a prefix, evictable."""
        with self._lock:
            if any(self._refs[block] <= 0 for block in blocks):
                raise RuntimeError("KV blocks freed twice")
            released = []
            for block in blocks:
                self._refs[block] -= 1
                if self._refs[block] == 1:
                    self._shared.discard(block)
                elif self._refs[block] == 0:
                    released.append(block)
            # A request's blocks are in prefix order: its tail goes first into the eviction
            # order, so eviction shortens a cached prefix rather than cutting off its root.
            for block in reversed(released):
                if block in self._cached:
                    self._evictable[block] = None
            # the first of them goes out first again
            self._free.extend(reversed([b for b in released if b not in self._cached]))

    def lookup(
        self,
        keys: Sequence[int],
        count: int,
        block_tokens: Callable[[int], Sequence[int]],
        matched: Sequence[int] = (),
        root: int = 0,
    ) -> list[int]:
        """The cached blocks of the longest prefix of `keys[:count]` (a sequence's prefix keys;
        `block_tokens(i)` gives its block i's tokens, compared to catch a hash collision),
        extending `matched`, the blocks of an earlier lookup of the same keys made with no
        eviction since."""
        blocks = list(matched)
        with self._lock:
            for index in range(len(blocks), count):
                block = self._by_key.get(keys[index])
                if block is None:
                    break
                cached = self._cached[block]
                parent = keys[index - 1] if index else root
                if cached.parent != parent or cached.tokens != tuple(block_tokens(index)):
                    break
                blocks.append(block)
        return blocks

    def num_in_use(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` some request holds (the rest, if cached, count as free)."""
        with self._lock:
            return sum(1 for block in blocks if self._refs[block] > 0)

    def is_cached(self, key: int) -> bool:
        """Whether a block is cached under `key` (a hint: it may be evicted at any time)."""
        return key in self._by_key

    @property
    def any_shared(self) -> bool:
        """Whether some block is held by more than one request."""
        return bool(self._shared)

    def num_shared(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (one request's) some other request holds too."""
        with self._lock:
            return len(self._shared.intersection(blocks))

    def share(self, blocks: Sequence[int]) -> None:
        """Take a reference to each of these cached blocks (from `lookup`)."""
        with self._lock:
            for block in blocks:
                if block not in self._cached:
                    raise RuntimeError(f"block {block} caches nothing and cannot be shared")
                self._refs[block] += 1
                if self._refs[block] == 2:
                    self._shared.add(block)
                self._evictable.pop(block, None)

    def register(
        self, block: int, key: int, parent: int, tokens: Sequence[int], block_size: int
    ) -> None:
        """Cache the full block `block` (in use, its KV computed) under `key`. A key cached
        already (another request computed the same prefix) keeps its block; this one stays
        uncached and is freed as usual."""
        if len(tokens) != block_size:
            raise ValueError(f"only full blocks are cached ({len(tokens)} of {block_size})")
        with self._lock:
            if key in self._by_key or block in self._cached or self._refs[block] <= 0:
                return
            self._by_key[key] = block
            self._cached[block] = _Cached(key, parent, tuple(tokens))
