"""The block allocator is shared by two lanes: all-or-nothing, thread-safe, leak-checked."""

from __future__ import annotations

import threading

import pytest

from bulletserve.kv.allocator import BlockAllocator, OutOfBlocksError
from bulletserve.kv.pool import parse_memory


def test_allocate_is_all_or_nothing():
    allocator = BlockAllocator(8)
    first = allocator.allocate(5)
    with pytest.raises(OutOfBlocksError, match="asked for 4 KV blocks, 3 free"):
        allocator.allocate(4)
    assert allocator.num_free == 3
    allocator.free(first)
    assert allocator.num_free == 8
    assert BlockAllocator.NULL_BLOCK not in allocator.allocate(8)


def test_concurrent_allocate_and_free_never_hand_out_a_block_twice():
    allocator = BlockAllocator(64)
    owned: list[list[int]] = [[], []]
    errors = []

    def worker(index: int) -> None:
        try:
            for round_ in range(2000):
                if round_ % 3 == 2 and owned[index]:
                    allocator.free(owned[index])
                    owned[index] = []
                else:
                    try:
                        owned[index] += allocator.allocate(1 + round_ % 4)
                    except OutOfBlocksError:
                        pass
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert not set(owned[0]) & set(owned[1])
    assert allocator.num_free + len(owned[0]) + len(owned[1]) == 64


def test_double_free_is_detected():
    allocator = BlockAllocator(2)
    blocks = allocator.allocate(2)
    allocator.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free(blocks)


@pytest.mark.parametrize(
    ("text", "value"), [("4GiB", 4 * 2**30), ("512MB", 512e6), ("0.25", 0.25), ("1e9", 1e9)]
)
def test_kv_cache_memory_parsing(text, value):
    assert parse_memory(text) == value


def test_freed_blocks_are_handed_out_again_first():
    """A stack: a server reuses the blocks it has touched before it touches new ones."""
    allocator = BlockAllocator(8)
    first = allocator.allocate(3)
    assert first == [1, 2, 3]
    allocator.free(first)
    assert allocator.allocate(2) == [1, 2]
    assert allocator.allocate(2) == [3, 4]


def test_gpu_memory_utilization_leaves_the_kv_cache_what_the_memory_in_use_does_not_take():
    """vLLM's budget: 0.9 of an 80 GiB device with 20 GiB in use (weights) leaves 52 GiB."""
    import torch

    from bulletserve.kv.pool import KVPool, kv_budget
    from bulletserve.model.presets import get_preset

    gib = 2**30
    assert kv_budget(0.9, 80 * gib, 60 * gib) == pytest.approx(52 * gib)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_budget(0.2, 80 * gib, 60 * gib)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        kv_budget(1.5, 80 * gib, 60 * gib)
    config = get_preset("tiny")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="on a CPU, --kv-cache-memory"):
        KVPool.num_blocks_for(config, 16, torch.float32, cpu, None, 4096, 0.9)
    with pytest.raises(ValueError, match="not both"):
        KVPool.num_blocks_for(config, 16, torch.float32, cpu, "1GiB", 4096, 0.9)
