"""Our Triton paged attention kernels against the float64 reference: on a GPU where there is
one, else in Triton's interpreter on CPU tensors (set in conftest), small shapes only."""

from __future__ import annotations

import pytest
import torch

from bulletserve.model.triton_attention import TritonDecodeAttention, TritonPrefillAttention
from tests.attention_reference import decode_reference, prefill_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def shuffled_tables(
    lengths: list[int], block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Distinct, shuffled blocks per sequence (block 0, the null block, in none); table entries
    past a context point at block 0. Returns the tables and the pool's block count."""
    counts = [-(-length // block_size) for length in lengths]
    num_blocks = sum(counts) + 3
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = torch.zeros(len(lengths), max(counts) + 1, dtype=torch.int32)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = torch.tensor(order[used : used + count])
        used += count
    return tables, num_blocks


def random_caches(num_slots, kv_heads, head_dim, dtype, generator, block_size):
    shape = (num_slots, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    # Stale NaNs in the null block, which padded reads may address, must never be read.
    k_cache[:block_size] = float("nan")
    v_cache[:block_size] = float("nan")
    return k_cache, v_cache


# (query heads, KV heads, head_dim): GQA ratios 3 (padded to a 16-row tile), 1, 8; a head_dim
# that is no power of two.
SHAPES = [(6, 2, 32), (2, 2, 16), (8, 1, 64), (4, 2, 80)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Ragged contexts around the 64-token tiles; SM counts that give one split and several.
@pytest.mark.parametrize(("lengths", "sm_count"), [([1, 17, 64, 130, 5], 1), ([200, 3], 64)])
def test_triton_decode_matches_reference(heads, kv_heads, head_dim, dtype, lengths, sm_count):
    generator = torch.Generator().manual_seed(0)
    block_size = 16
    tables, num_blocks = shuffled_tables(lengths, block_size, generator)
    k_cache, v_cache = random_caches(
        num_blocks * block_size, kv_heads, head_dim, dtype, generator, block_size
    )
    # a column slice of the fused projection, as the model hands it over
    fused = torch.randn(len(lengths), (heads + 2 * kv_heads) * head_dim, generator=generator)
    q = fused.to(dtype)[:, : heads * head_dim].view(len(lengths), heads, head_dim)
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    kernel = TritonDecodeAttention(head_dim, heads // kv_heads, sm_count)
    assert (kernel.splits(len(lengths), kv_heads) > 1) == (sm_count > 1)
    out = torch.full((len(lengths) + 1, heads, head_dim), 7.0, dtype=dtype, device=DEVICE)

    on = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)]
    kernel(*on[:3], on[3], on[4], block_size, scale, out[: len(lengths)])

    expected = decode_reference(q, k_cache, v_cache, tables, lens, block_size, scale)
    result = out.cpu()
    assert (result[len(lengths) :] == 7.0).all()  # rows past the batch are left alone
    assert torch.isfinite(result[: len(lengths)]).all()
    tolerance = TOLERANCE[dtype]
    assert torch.allclose(result[: len(lengths)].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (cached tokens, new tokens) per sequence: whole prompts, chunks after earlier ones (prefix
# not a multiple of the block), lengths around the 64-row tiles.
@pytest.mark.parametrize("spans", [[(0, 7), (0, 65), (30, 35), (5, 2)], [(150, 70)]])
def test_triton_prefill_matches_reference(heads, kv_heads, head_dim, dtype, spans):
    generator = torch.Generator().manual_seed(0)
    block_size = 16
    tables, num_blocks = shuffled_tables([c + n for c, n in spans], block_size, generator)
    k_cache, v_cache = random_caches(
        num_blocks * block_size, kv_heads, head_dim, dtype, generator, block_size
    )
    tokens = sum(new for _, new in spans)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q = fused.to(dtype)[:, : heads * head_dim].view(tokens, heads, head_dim)
    starts = [sum(new for _, new in spans[:i]) for i in range(len(spans))]
    meta = torch.tensor(
        [starts, [new for _, new in spans], [cached for cached, _ in spans]], dtype=torch.int32
    )
    scale = head_dim**-0.5
    out = torch.full((tokens + 2, heads, head_dim), 7.0, dtype=dtype, device=DEVICE)

    on = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, meta)]
    TritonPrefillAttention(head_dim, heads // kv_heads)(*on, block_size, scale, out)

    result = out.cpu()
    assert (result[tokens:] == 7.0).all()
    tolerance = TOLERANCE[dtype]
    for row, ((cached, new), start) in enumerate(zip(spans, starts, strict=True)):
        rows = slice(start, start + new)
        expected = prefill_reference(
            q[rows], k_cache, v_cache, tables[row], cached, block_size, scale
        )
        assert torch.isfinite(result[rows]).all()
        assert torch.allclose(result[rows].double(), expected, atol=tolerance, rtol=tolerance)
