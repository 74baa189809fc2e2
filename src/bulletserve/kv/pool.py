"""The paged KV pool: one K and one V tensor per layer, indexed by slot = block * size + offset."""

from __future__ import annotations

import psutil
import torch

from bulletserve.kv.allocator import BlockAllocator
from bulletserve.model.config import ModelConfig

DEFAULT_MEMORY_FRACTION = 0.3


def parse_memory(value: str) -> float:
    """`--kv-cache-memory`: bytes (`4e9`, `4GiB`, `512MB`) or a fraction of free memory (`0.3`)."""
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available


class KVPool:
    """KV storage for `num_blocks` blocks (+ the zeroed null block) and their allocator."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, prefix_caching)
        num_slots = (num_blocks + 1) * block_size
        shape = (config.num_layers, 2, num_slots, config.num_kv_heads, config.head_dim)
        # torch.empty: pages of untouched blocks are never committed on a CPU.
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.kv[:, :, :block_size].zero_()
        if self.kv.is_cuda:
            torch.cuda.synchronize(device)  # lanes' streams do not wait for the default stream
        self.layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(config.num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @staticmethod
    def blocks_for_memory(
        config: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: float
    ) -> int:
        bytes_per_block = config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size
        return int(memory_bytes // bytes_per_block)

    @classmethod
    def num_blocks_for(
        cls,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_memory: str | None,
        max_tokens_needed: int,
        gpu_memory_utilization: float | None = None,
    ) -> int:
        """The blocks of `kv_cache_memory` (bytes or fraction of free memory; default 0.3 of
        free) or, on a GPU, of what `gpu_memory_utilization` of its memory leaves beside what
        is in use (the weights loaded); never more than `max_tokens_needed` tokens hold."""
        if gpu_memory_utilization is not None:
            if kv_cache_memory is not None:
                raise ValueError("give --gpu-memory-utilization or --kv-cache-memory, not both")
            if device.type != "cuda":
                raise ValueError(
                    "--gpu-memory-utilization sizes the KV cache on a GPU; on a CPU, "
                    "--kv-cache-memory does (bytes, or a fraction of free memory)"
                )
            free, total = torch.cuda.mem_get_info(device)
            memory = kv_budget(gpu_memory_utilization, total, free)
        else:
            amount = (
                DEFAULT_MEMORY_FRACTION
                if kv_cache_memory is None
                else parse_memory(kv_cache_memory)
            )
            if amount <= 0:
                raise ValueError(f"--kv-cache-memory must be positive, not {kv_cache_memory!r}")
            memory = amount * free_device_memory(device) if amount <= 1 else amount
        num_blocks = cls.blocks_for_memory(config, block_size, dtype, memory)
        return min(num_blocks, -(-max_tokens_needed // block_size))


def kv_budget(utilization: float, total: int, free: int) -> float:
    """vLLM's `--gpu-memory-utilization`: of `utilization` x the device's memory, what the
    memory in use now (the weights, anything else on the device) leaves for the KV cache.
    Activations take theirs from the rest of the device."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {utilization}")
    budget = utilization * total - (total - free)
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves no room for the KV cache: "
            f"{(total - free) / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB are in "
            "use already; raise it"
        )
    return budget
