"""Paged attention for CUDA in Triton, reading the KV blocks in place.

- Decode (`TritonDecodeAttention`): flash-decoding. One program per (sequence, KV head, split)
  takes all the query heads that share the KV head as the rows of one tile (grouped-query
  attention reads each key once), walks its share of the context through the block table, and
  writes a partial result; a second kernel merges the splits. The number of splits depends only
  on the batch (each sequence cuts its own context into that many parts), so a captured CUDA
  graph serves every context length.
- Prefill (`TritonPrefillAttention`): causal flash attention of each prompt's new rows over its
  whole context, the cached prefix or earlier chunks included, read from the cache after the
  step's new keys and values were written there.

Both take the same arguments as our CPU kernels (`cpu_kernels`), so `paged_attention` calls
either. Under `TRITON_INTERPRET=1` they run on CPU tensors (slowly), which is how CI tests them.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
import triton
import triton.language as tl

# Aim for this many decode programs per streaming multiprocessor when choosing splits.
PROGRAMS_PER_SM = 4
MAX_DECODE_SPLITS = 16
DECODE_TILE = 64  # context tokens a decode program scores at once
PREFILL_QUERY_TILE = 64
PREFILL_KEY_TILE = 64


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b; in full fp32 for fp32 models and under Triton's interpreter, whose dot misreads
    bf16 operands (Triton 3.9)."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(
    q,
    k_ptr,
    v_ptr,
    table_ptr,
    positions,
    valid,
    visible,
    head_offset,
    dims,
    dim_ok,
    kv_stride_slot,
    scale,
    best,
    total,
    acc,
    BLOCK_SIZE: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """One online-softmax step over the context tokens `positions` (those `valid` read from the
    cache through the block table at `table_ptr`, those `visible` to each query row attended):
    the running (row maxima, row sums, weighted values) after it."""
    blocks = tl.load(table_ptr + positions // BLOCK_SIZE, mask=valid, other=0)
    slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    where = slots[:, None] * kv_stride_slot + head_offset + dims[None, :]
    loaded = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + where, mask=loaded, other=0.0)
    scores = _dot(q, tl.trans(k), FP32_DOT)
    scores = tl.where(visible, scores * scale, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    weights = tl.exp(scores - new_best[:, None])
    rescale = tl.exp(best - new_best)
    total = total * rescale + tl.sum(weights, 1)
    v = tl.load(v_ptr + where, mask=loaded, other=0.0)
    acc = acc * rescale[:, None] + _dot(weights.to(v.dtype), v, FP32_DOT)
    return new_best, total, acc


@triton.jit
def _decode_split(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    q_stride_b,
    q_stride_h,
    kv_stride_slot,
    kv_stride_h,
    tables_stride,
    out_stride_b,
    out_stride_h,
    scale,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), TILE) * TILE
    begin = split * per_split
    end = tl.minimum(begin + per_split, context)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    best = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    offsets = tl.arange(0, TILE)
    for start in range(begin, end, TILE):
        positions = start + offsets
        valid = positions < end
        best, total, acc = _attend_tile(
            q,
            k_ptr,
            v_ptr,
            tables_ptr + seq * tables_stride,
            positions,
            valid,
            valid[None, :],
            kv_head * kv_stride_h,
            dims,
            dim_ok,
            kv_stride_slot,
            scale,
            best,
            total,
            acc,
            BLOCK_SIZE,
            FP32_DOT,
        )

    if NUM_SPLITS == 1:
        where = seq * out_stride_b + heads[:, None] * out_stride_h + dims[None, :]
        result = acc / total[:, None]
        tl.store(
            out_ptr + where,
            result.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Partial results, [batch, heads, splits (, dims)]; an empty split keeps -inf and 0.
        part = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, best, mask=row_ok)
        tl.store(part_sum_ptr + part, total, mask=row_ok)
        tl.store(
            part_out_ptr + part[:, None] * DIM_PAD + dims[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def _decode_merge(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
    best = tl.load(part_max_ptr + part)
    total = tl.load(part_sum_ptr + part)
    acc = tl.load(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :])
    overall = tl.max(best, 0)
    weights = tl.where(best == float("-inf"), 0.0, tl.exp(best - overall))
    result = tl.sum(acc * weights[:, None], 0) / tl.sum(total * weights, 0)
    tl.store(
        out_ptr + seq * out_stride_b + head * out_stride_h + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit
def _prefill(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    starts_ptr,
    lengths_ptr,
    cached_ptr,
    out_ptr,
    q_stride_t,
    q_stride_h,
    kv_stride_slot,
    kv_stride_h,
    tables_stride,
    out_stride_t,
    out_stride_h,
    scale,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    QUERY_TILE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    length = tl.load(lengths_ptr + seq)
    if tile * QUERY_TILE >= length:
        return
    first_row = tl.load(starts_ptr + seq)
    cached = tl.load(cached_ptr + seq)
    kv_head = head // GROUP

    rows = tile * QUERY_TILE + tl.arange(0, QUERY_TILE)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < length
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr
        + (first_row + rows)[:, None].to(tl.int64) * q_stride_t
        + head * q_stride_h
        + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    query_positions = cached + rows
    best = tl.full([QUERY_TILE], float("-inf"), dtype=tl.float32)
    total = tl.zeros([QUERY_TILE], dtype=tl.float32)
    acc = tl.zeros([QUERY_TILE, DIM_PAD], dtype=tl.float32)
    # Keys up to the tile's last query (causal): its cached prefix and its own new rows.
    end = cached + tl.minimum((tile + 1) * QUERY_TILE, length)
    offsets = tl.arange(0, KEY_TILE)
    for start in range(0, end, KEY_TILE):
        positions = start + offsets
        valid = positions < end
        best, total, acc = _attend_tile(
            q,
            k_ptr,
            v_ptr,
            tables_ptr + seq * tables_stride,
            positions,
            valid,
            valid[None, :] & (positions[None, :] <= query_positions[:, None]),
            kv_head * kv_stride_h,
            dims,
            dim_ok,
            kv_stride_slot,
            scale,
            best,
            total,
            acc,
            BLOCK_SIZE,
            FP32_DOT,
        )
    result = acc / total[:, None]
    tl.store(
        out_ptr
        + (first_row + rows)[:, None].to(tl.int64) * out_stride_t
        + head * out_stride_h
        + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or {k_cache.dtype, v_cache.dtype} != {q.dtype}:
        raise ValueError("k_cache and v_cache must share q's dtype and one layout")
    if k_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q and the caches need unit stride along head_dim")


def _power_of_two_at_least(value: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(value))


class TritonDecodeAttention:
    """Decode attention over the paged cache for one (head_dim, group) shape on `sm_count` SMs
    (the lane's share, which sets how finely the context is split)."""

    label: ClassVar[str] = "Triton, paged in place"

    def __init__(self, head_dim: int, group: int, sm_count: int) -> None:
        self.head_dim, self.group, self.sm_count = head_dim, group, sm_count

    def splits(self, batch: int, num_kv_heads: int) -> int:
        """Context splits per sequence: enough programs to cover the SMs a few times over."""
        wanted = -(-PROGRAMS_PER_SM * self.sm_count // max(1, batch * num_kv_heads))
        return min(MAX_DECODE_SPLITS, triton.next_power_of_2(max(1, wanted)))

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
    ) -> None:
        """Writes into `out` ([B, H, D]) the attention of q ([B, H, D], unit element stride)
        over each sequence's `context_lens` tokens; caches: [slots, KVH, D] with slot = block *
        block_size + offset; block_tables: int32 [B, max_blocks]. Every context is >= 1."""
        _check_caches(q, k_cache, v_cache)
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        if batch == 0:
            return
        splits = self.splits(batch, num_kv_heads)
        dim_pad = _power_of_two_at_least(head_dim, 16)
        # One split writes its result straight to `out` and leaves the partial buffers unused.
        partial = dict.fromkeys(("part_out_ptr", "part_max_ptr", "part_sum_ptr"), out)
        if splits > 1:
            shape = (batch, num_heads, splits)
            partial = {
                "part_out_ptr": q.new_empty((*shape, dim_pad), dtype=torch.float32),
                "part_max_ptr": q.new_empty(shape, dtype=torch.float32),
                "part_sum_ptr": q.new_empty(shape, dtype=torch.float32),
            }
        _decode_split[(batch, num_kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out_ptr=out,
            q_stride_b=q.stride(0),
            q_stride_h=q.stride(1),
            kv_stride_slot=k_cache.stride(0),
            kv_stride_h=k_cache.stride(1),
            tables_stride=block_tables.stride(0),
            out_stride_b=out.stride(0),
            out_stride_h=out.stride(1),
            scale=scale,
            NUM_SPLITS=splits,
            BLOCK_SIZE=block_size,
            GROUP=self.group,
            GROUP_PAD=_power_of_two_at_least(self.group, 16),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            TILE=DECODE_TILE,
            FP32_DOT=q.dtype == torch.float32 or interpreted(),
            **partial,
        )
        if splits > 1:
            _decode_merge[(batch, num_heads)](
                partial["part_out_ptr"],
                partial["part_max_ptr"],
                partial["part_sum_ptr"],
                out,
                out.stride(0),
                out.stride(1),
                NUM_SPLITS=splits,
                HEAD_DIM=head_dim,
                DIM_PAD=dim_pad,
            )


class TritonPrefillAttention:
    """Causal prefill attention over each sequence's cached and new keys."""

    label: ClassVar[str] = "Triton, paged in place"

    def __init__(self, head_dim: int, group: int) -> None:
        self.head_dim, self.group = head_dim, group

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
    ) -> None:
        """Writes into `out` ([T', H, D], T' >= T) the attention of q ([T, H, D], unit element
        stride); the caches already hold the new keys and values; block_tables: int32
        [S, max_blocks]; spans: int32 [3, S], each sequence's first query row, query length and
        cached length."""
        _check_caches(q, k_cache, v_cache)
        tokens, num_heads, head_dim = q.shape
        num_seqs = spans.shape[1]
        if num_seqs == 0:
            return
        # No span is longer than the rows the others leave; reading the true longest from a
        # device tensor would stall the host, and programs past a span's end return at once.
        longest = tokens - (num_seqs - 1)
        grid = (triton.cdiv(longest, PREFILL_QUERY_TILE), num_seqs, num_heads)
        _prefill[grid](
            q,
            k_cache,
            v_cache,
            block_tables,
            spans[0],
            spans[1],
            spans[2],
            out,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            scale,
            BLOCK_SIZE=block_size,
            GROUP=self.group,
            HEAD_DIM=head_dim,
            DIM_PAD=_power_of_two_at_least(head_dim, 16),
            QUERY_TILE=PREFILL_QUERY_TILE,
            KEY_TILE=PREFILL_KEY_TILE,
            FP32_DOT=q.dtype == torch.float32 or interpreted(),
        )
