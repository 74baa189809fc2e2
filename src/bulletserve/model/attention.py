"""Attention over a paged KV cache for a ragged batch of prefills and decodes.

A step's tokens are laid out flat: every prefill's new tokens first (one sequence after another),
then one token per decoding sequence. The metadata is built once per step by the model runner
and shared by all layers.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from bulletserve.model.cpu_kernels import FusedOps, PrefillAttentionKernel
from bulletserve.model.lora import LoRABatch

log = logging.getLogger(__name__)


class DecodeKernel(Protocol):
    """Decode attention reading the paged cache in place (`cpu_kernels` on a CPU,
    `triton_attention` on CUDA)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


class PrefillKernel(Protocol):
    """Causal prefill attention over cached and new keys, reading the paged cache in place."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        spans: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


def triton_kernels(
    head_dim: int, group: int, device: torch.device
) -> tuple[DecodeKernel | None, PrefillKernel | None]:
    """Our Triton kernels on a CUDA device, or (None, None) with a warning where Triton is
    missing or `BULLET_TRITON=0` (then attention gathers each context for PyTorch's SDPA)."""
    if os.environ.get("BULLET_TRITON") == "0":
        return None, None
    try:
        from bulletserve.model.triton_attention import (
            TritonDecodeAttention,
            TritonPrefillAttention,
        )
    except ImportError as error:
        log.warning("no Triton (%s): attention gathers every context for PyTorch SDPA", error)
        return None, None
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return TritonDecodeAttention(head_dim, group, sm_count), TritonPrefillAttention(head_dim, group)


@dataclass
class PrefillSpan:
    """One sequence computing `query_len` new tokens after `cached_len` tokens already cached."""

    query_start: int
    query_len: int
    cached_len: int
    # Cache slots of all `cached_len + query_len` tokens; None when nothing was cached before,
    # in which case attention runs on the fresh keys directly.
    context_slots: torch.Tensor | None
    # Causal mask over the context, [query_len, cached_len + query_len]; None without a prefix.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V is written
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    # The step's tokens; the rows after them (a CPU step pads its rows, engine.model_runner) are
    # computed row by row like the others but neither cached nor attended.
    num_tokens: int
    # Decodes through PyTorch SDPA: cache slots of each sequence's context, padded with the
    # null slot, and the matching validity mask.
    decode_slots: torch.Tensor | None = None  # [batch, max_context]
    decode_mask: torch.Tensor | None = None  # [batch, 1, 1, max_context]
    # Writes the new keys and values through our CPU op (else index_copy_).
    kv_writer: FusedOps | None = None
    # Prefills through our kernel, which reads the blocks in place: every span's block table,
    # and int32 [3, spans] of first query row, query length and cached length.
    prefill_kernel: PrefillKernel | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_spans: torch.Tensor | None = None
    # Decodes through our kernel, which reads the blocks in place.
    decode_kernel: DecodeKernel | None = None
    decode_block_tables: torch.Tensor | None = None  # int32 [batch, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # int32 [batch]
    block_size: int = 0
    # The step's rows grouped by LoRA adapter (None: no row uses one).
    lora: LoRABatch | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [slots, KVH, D]. Returns [T, H, D].

    Writes the new keys and values into the cache, then attends each token to its context.
    Padding rows (past `meta.num_tokens`) come out as zeros.
    """
    tokens = meta.num_tokens
    out = torch.empty_like(q)
    if tokens < q.shape[0]:  # padded: skipped otherwise, as it runs in every layer of every step
        k, v = k[:tokens], v[:tokens]
        out[tokens:] = 0
    if meta.kv_writer is not None:
        meta.kv_writer.kv_write(k, v, meta.slot_mapping, k_cache, v_cache)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.prefill_kernel is not None and meta.prefills:
        meta.prefill_kernel(
            q[: meta.num_prefill_tokens],
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_spans,
            meta.block_size,
            scale,
            out,
        )
    for span in meta.prefills if meta.prefill_kernel is None else ():
        rows = slice(span.query_start, span.query_start + span.query_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if span.context_slots is None:
            ks = k[rows].transpose(0, 1).unsqueeze(0)
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            ks = k_cache.index_select(0, span.context_slots).transpose(0, 1).unsqueeze(0)
            vs = v_cache.index_select(0, span.context_slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True
            )
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode_kernel is not None and meta.decode_block_tables is not None:
        meta.decode_kernel(
            q[meta.num_prefill_tokens : tokens],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.block_size,
            scale,
            out[meta.num_prefill_tokens : tokens],
        )
    elif meta.decode_slots is not None:
        batch, max_context = meta.decode_slots.shape
        flat = meta.decode_slots.reshape(-1)
        kvh, dim = k_cache.shape[1], k_cache.shape[2]
        kd = k_cache.index_select(0, flat).view(batch, max_context, kvh, dim).transpose(1, 2)
        vd = v_cache.index_select(0, flat).view(batch, max_context, kvh, dim).transpose(1, 2)
        # The query heads sharing a KV head (h = kv * group + g) become that head's query rows:
        # one token each, all with the same context and mask, so attention needs no GQA
        # expansion of K/V (which SDPA's math path would copy group-fold) and no causal mask.
        group = q.shape[1] // kvh
        qd = q[meta.num_prefill_tokens : tokens].reshape(batch, kvh, group, dim)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[meta.num_prefill_tokens : tokens] = o.reshape(batch, kvh * group, dim)
    return out


# The prompt shape `prefill_kernel_outruns_sdpa` times: a fresh prompt, then a chunk of as many
# tokens after it, the case where PyTorch's path also gathers the context and applies a mask.
TIMED_PROMPT_TOKENS = 256
_outruns_sdpa: dict[tuple, bool] = {}


def prefill_kernel_outruns_sdpa(
    kernel: PrefillAttentionKernel,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int = 5,
) -> bool:
    """Whether our prefill kernel runs a prompt's attention faster than PyTorch's SDPA here, both
    through `paged_attention`, timed alternately on the calling thread (once per shape and
    thread count). On a Xeon with AMX both run bf16 on tiles, and ours took 0.7-0.75x SDPA's
    time on this test's shape (0.6-0.9x from 4 x 256 to 2,048 tokens); elsewhere ours is 1.4-3x
    faster."""
    key = (num_heads, num_kv_heads, head_dim, dtype, torch.get_num_threads())
    if key in _outruns_sdpa:
        return _outruns_sdpa[key]
    tokens, block_size = TIMED_PROMPT_TOKENS, 16
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
        for heads in (num_heads, num_kv_heads, num_kv_heads)
    )
    k_cache, v_cache = (torch.zeros(2 * tokens, num_kv_heads, head_dim, dtype=dtype) for _ in "kv")
    blocks = torch.arange(2 * tokens // block_size, dtype=torch.int32).unsqueeze(0)
    keys, queries = torch.arange(2 * tokens), torch.arange(tokens, 2 * tokens)
    steps = []  # (kernel's metadata, SDPA's metadata) of the fresh prompt and of the chunk
    for cached in (0, tokens):
        slots = torch.arange(cached, cached + tokens)
        span = PrefillSpan(0, tokens, cached, None, None)
        if cached:
            span = PrefillSpan(0, tokens, cached, keys, keys.unsqueeze(0) <= queries.unsqueeze(1))
        common = {"slot_mapping": slots, "num_prefill_tokens": tokens, "num_tokens": tokens}
        ours = AttentionMetadata(
            prefills=[PrefillSpan(0, tokens, cached, None, None)],
            prefill_kernel=kernel,
            prefill_block_tables=blocks,
            prefill_spans=torch.tensor([[0], [tokens], [cached]], dtype=torch.int32),
            block_size=block_size,
            **common,
        )
        steps.append((ours, AttentionMetadata(prefills=[span], **common)))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats + 1):  # the first round warms caches and thread teams up
        for index in range(2):
            start = time.perf_counter()
            for metas in steps:
                paged_attention(q, k, v, k_cache, v_cache, metas[index], head_dim**-0.5)
            times[index].append(time.perf_counter() - start)
    ours_s, sdpa_s = (statistics.median(t[1:]) for t in times)
    _outruns_sdpa[key] = ours_s < sdpa_s
    log.info(
        "prefill attention of %d + %d tokens: our kernel %.2f ms, PyTorch SDPA %.2f ms; using %s",
        tokens,
        tokens,
        ours_s * 1e3,
        sdpa_s * 1e3,
        "ours" if ours_s < sdpa_s else "SDPA",
    )
    return _outruns_sdpa[key]
