"""Our C kernels against plain PyTorch references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bulletserve.model import attention, cpu_kernels
from bulletserve.model.cpu_kernels import (
    blocked_linear_kernel,
    decode_attention_kernel,
    fused_ops,
    onednn_linear_kernel,
    packed_linear_kernel,
    prefill_attention_kernel,
)
from bulletserve.model.decoder import Linear, apply_rope
from tests.attention_reference import decode_reference, prefill_reference


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "tolerance"),
    [
        (torch.float32, 9, 3, 64, 1e-5),
        (torch.float32, 4, 4, 16, 1e-5),
        (torch.float32, 8, 1, 128, 1e-5),
        (torch.bfloat16, 9, 3, 64, 2e-2),
    ],
)
# Many sequences: one work item per sequence; one: one item per KV head.
@pytest.mark.parametrize("lengths", [[1, 16, 17, 100, 250, 3], [250]])
def test_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim, tolerance, lengths):
    kernel = decode_attention_kernel(dtype, head_dim, heads // kv_heads, torch.device("cpu"))
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 40
    lens = torch.tensor(lengths, dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    # Distinct, shuffled blocks per sequence; unused table entries point at block 0.
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, length in enumerate(lens.tolist()):
        count = -(-length // block_size)
        tables[b, :count] = order[used : used + count]
        used += count
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    # Stale NaNs past every context must not leak into the output.
    k_cache[0:block_size] = float("nan")
    q = torch.randn(len(lens), heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5

    out = torch.empty_like(q)
    kernel(q, k_cache, v_cache, tables, lens, block_size, scale, out)
    expected = decode_reference(q, k_cache, v_cache, tables, lens, block_size, scale)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "tolerance"),
    [
        (torch.float32, 9, 3, 64, 1e-5),
        (torch.float32, 4, 4, 16, 1e-5),
        (torch.float32, 8, 1, 128, 1e-5),
        (torch.bfloat16, 9, 3, 64, 2e-2),
        (torch.bfloat16, 8, 1, 128, 2e-2),
    ],
)
# (cached tokens, new tokens) per sequence: whole prompts, later chunks after earlier ones,
# single tokens, lengths around the kernel's 64-key tiles and 512-key spans.
@pytest.mark.parametrize(
    "spans", [[(0, 7), (0, 64), (30, 35), (0, 1), (5, 1)], [(500, 90)], [(0, 130)]]
)
def test_prefill_attention_matches_reference(dtype, heads, kv_heads, head_dim, tolerance, spans):
    kernel = prefill_attention_kernel(dtype, head_dim, heads // kv_heads, torch.device("cpu"))
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    generator = torch.Generator().manual_seed(0)
    block_size = 16
    counts = [-(-(cached + new) // block_size) for cached, new in spans]
    num_blocks = sum(counts) + 3
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = torch.zeros(len(spans), max(counts), dtype=torch.int32)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = torch.tensor(order[used : used + count])
        used += count
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    k_cache[0:block_size] = float("nan")  # stale memory past every context stays unread
    v_cache[0:block_size] = float("nan")
    tokens = sum(new for _, new in spans)
    # a column slice of a wider projection, as the model hands it over
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    starts = [sum(new for _, new in spans[:i]) for i in range(len(spans))]
    meta = torch.tensor(
        [starts, [new for _, new in spans], [cached for cached, _ in spans]], dtype=torch.int32
    )
    scale = head_dim**-0.5
    out = torch.full((tokens + 2, heads, head_dim), 7.0, dtype=dtype)

    kernel(q, k_cache, v_cache, tables, meta, block_size, scale, out)
    assert (out[tokens:] == 7.0).all()  # rows past the spans are left alone
    for row, ((cached, new), start) in enumerate(zip(spans, starts, strict=True)):
        rows = slice(start, start + new)
        expected = prefill_reference(
            q[rows], k_cache, v_cache, tables[row], cached, block_size, scale
        )
        assert torch.isfinite(out[rows]).all()
        assert torch.allclose(out[rows].double(), expected, atol=tolerance, rtol=tolerance)


def test_bf16_prefill_attention_runs_on_amx_wherever_the_cpu_has_it():
    """On a CPU with AMX (bf16 tiles) the kernel's bf16 path is the tile one, and it is what
    `test_prefill_attention_matches_reference` checks there; elsewhere the vector path."""
    kernel = prefill_attention_kernel(torch.bfloat16, 64, 3, torch.device("cpu"))
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert kernel.on_amx == ("amx_bf16" in flags.split())
    assert not prefill_attention_kernel(torch.float32, 64, 3, torch.device("cpu")).on_amx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_timed_against_sdpa_once_per_shape(dtype, monkeypatch):
    """The runner keeps our prefill kernel only where it outruns SDPA; the timing runs both
    paths of paged_attention once per shape and thread count, then answers from its record."""
    kernel = prefill_attention_kernel(dtype, 32, 2, torch.device("cpu"))
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setattr(attention, "_outruns_sdpa", {})
    monkeypatch.setattr(attention, "TIMED_PROMPT_TOKENS", 32)
    first = attention.prefill_kernel_outruns_sdpa(kernel, 4, 2, 32, dtype, repeats=1)
    assert isinstance(first, bool)
    assert list(attention._outruns_sdpa.values()) == [first]
    monkeypatch.setattr(attention, "paged_attention", None)  # a second timing would fail
    assert attention.prefill_kernel_outruns_sdpa(kernel, 4, 2, 32, dtype) is first


def test_unusable_shapes_fall_back():
    cpu = torch.device("cpu")
    assert decode_attention_kernel(torch.float16, 64, 3, cpu) is None
    assert decode_attention_kernel(torch.float32, 24, 3, cpu) is None
    assert decode_attention_kernel(torch.float32, 64, 3, torch.device("meta")) is None
    assert prefill_attention_kernel(torch.float16, 64, 3, cpu) is None
    assert prefill_attention_kernel(torch.float32, 24, 3, cpu) is None


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_ops_match_pytorch(dtype, tolerance):
    ops = fused_ops(dtype, torch.device("cpu"))
    if ops is None:
        pytest.skip("no C compiler on this machine")
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    def close(ours, expected):
        return torch.allclose(ours.float(), expected.float(), atol=tolerance, rtol=tolerance)

    rows, dim, eps = 37, 96, 1e-6
    x, residual, weight = randn(rows, dim), torch.randn(rows, dim, generator=generator), randn(dim)

    def rmsnorm(values):
        values = values.float()
        return weight * (values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    total = residual + x.float()
    stream = residual.clone()
    out = ops.add_rmsnorm(x, stream, weight, eps)
    assert torch.allclose(stream, total, atol=1e-6)  # the fp32 stream, updated in place
    assert close(out, rmsnorm(total))
    assert close(ops.add_rmsnorm(None, total.clone(), weight, eps), rmsnorm(total))
    assert close(ops.rmsnorm(x, weight, eps), rmsnorm(x))

    heads, head_dim, max_positions = 3, 32, 300
    qkv = randn(rows, 2 * heads * head_dim)  # rotate the first half's heads in place
    positions = torch.randint(0, max_positions, (rows,), generator=generator)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), torch.rand(16))
    cos_table, sin_table = angles.cos(), angles.sin()
    view = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    expected = apply_rope(
        view.float(), cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    )
    untouched = qkv[:, heads * head_dim :].clone()
    ops.rope_(view, positions, cos_table, sin_table)
    assert close(view, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)

    gate_up = randn(rows, 2 * dim)
    gate, up = gate_up.float().split(dim, dim=-1)
    assert close(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_copies_strided_rows_into_their_slots(dtype):
    ops = fused_ops(dtype, torch.device("cpu"))
    if ops is None:
        pytest.skip("no C compiler on this machine")
    generator = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim = 300, 3, 16  # past the op's threshold for threads
    fused = torch.randn(tokens, 9 * dim, generator=generator).to(dtype)
    k = fused[:, 3 * dim : 6 * dim].view(tokens, kv_heads, dim)  # a column slice
    v = fused[:, 6 * dim :].reshape(tokens, kv_heads, dim).clone()  # contiguous
    slots = torch.randperm(1000, generator=generator)[:tokens]
    k_cache = torch.zeros(1000, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros(1000, kv_heads, dim, dtype=dtype)
    ops.kv_write(k, v, slots, k_cache, v_cache)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert (k_cache[untouched] == 0).all() and (v_cache[untouched] == 0).all()
    with pytest.raises(ValueError, match="int64"):
        ops.kv_write(k, v, slots.int(), k_cache, v_cache)


@pytest.mark.parametrize(
    ("getter", "dtype"),
    [
        (onednn_linear_kernel, torch.float32),
        (onednn_linear_kernel, torch.bfloat16),
        (blocked_linear_kernel, torch.float32),
    ],
)
@pytest.mark.parametrize(("width", "out", "bias"), [(576, 960, False), (45, 19, True)])
def test_packed_linear_matches_pytorch_at_any_rows(getter, dtype, width, out, bias):
    kernel = getter(dtype, torch.device("cpu"))
    if kernel is None:
        pytest.skip("this kernel cannot run this dtype on this CPU")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out, width, generator=generator).to(dtype)
    b = torch.randn(out, generator=generator).to(dtype) if bias else None
    packed = kernel.pack(weight)
    x = torch.randn(400, width, generator=generator).to(dtype)
    full = kernel(x, packed, out, b)
    assert full.dtype == dtype
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(full.double(), expected, atol=tolerance * width**0.5, rtol=tolerance)
    for rows in [1, 5, 13, 17, 191, 399]:
        part = kernel(x[:rows], packed, out, b)
        assert torch.allclose(part.double(), expected[:rows], atol=tolerance * width**0.5), rows
    assert kernel(x.view(8, 50, width), packed, out, b).shape == (8, 50, out)
    with pytest.raises(ValueError, match="must be"):
        kernel(x.to(torch.float16), packed, out)
    with pytest.raises(ValueError, match="does not hold"):
        kernel(x, packed, out + 16)


def test_packed_linear_is_on_the_cpu_only_and_the_fastest_eligible_is_kept(monkeypatch):
    cpu = torch.device("cpu")
    assert packed_linear_kernel(torch.float16, cpu) is None
    assert packed_linear_kernel(torch.float32, torch.device("meta")) is None
    assert blocked_linear_kernel(torch.bfloat16, cpu) is None
    onednn, blocked = (
        onednn_linear_kernel(torch.float32, cpu),
        blocked_linear_kernel(torch.float32, cpu),
    )
    if onednn is None or blocked is None:
        pytest.skip("oneDNN or a C compiler is missing here")
    assert packed_linear_kernel(torch.float32, cpu) == onednn
    weights = [torch.randn(16, 8)]
    seconds, base = cpu_kernels._time_linears([onednn, blocked], weights, 3)
    assert len(seconds) == 2 and all(s > 0 for s in [*seconds, base])
    timed_rows = []

    def timings(at_decode: list[float], at_prefill: list[float]):
        def fake(kernels, _weights, rows):
            assert [type(k) for k in kernels] == [type(onednn), type(blocked)]
            timed_rows.append(rows)
            return (at_decode if rows < 100 else at_prefill), 1.5

        return fake

    # PyTorch takes 1.5 at both rows. Eligible: faster at decode rows, within 10% at prefill;
    # of those, the lowest sum of the two (relative to PyTorch's) is kept.
    cases = [
        ([1.0, 1.2], [1.0, 1.0], onednn),
        ([1.2, 1.0], [1.0, 1.0], blocked),
        ([1.0, 0.5], [1.6, 1.7], onednn),  # the blocked one is too slow at prefill rows
        ([1.6, 1.0], [1.0, 1.4], blocked),  # oneDNN is slower than PyTorch at decode rows
        ([1.0, 1.0], [1.7, 1.8], None),
    ]
    for decode, prefill, kept in cases:
        monkeypatch.setattr(cpu_kernels, "_time_linears", timings(decode, prefill))
        assert packed_linear_kernel(torch.float32, cpu, weights) == kept
    assert set(timed_rows) == {cpu_kernels.DECODE_ROWS, cpu_kernels.PREFILL_ROWS}


@torch.inference_mode()
@pytest.mark.parametrize("getter", [onednn_linear_kernel, blocked_linear_kernel])
def test_packed_linear_module_frees_its_weight_and_computes_the_same(getter):
    kernel = getter(torch.float32, torch.device("cpu"))
    if kernel is None:
        pytest.skip("this kernel cannot run here")
    torch.manual_seed(0)
    module = Linear(40, 35, bias=True)
    torch.nn.init.normal_(module.weight)
    torch.nn.init.normal_(module.bias)
    x = torch.randn(3, 7, 40)
    expected = module(x)
    module.use_packed(kernel)
    assert "weight" not in dict(module.named_parameters())
    assert torch.allclose(module(x), expected, atol=1e-5, rtol=1e-5)


def test_openmp_wait_policy_is_set_before_torch_loads_and_never_overrides_the_user():
    script = "import os, bulletserve, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "active", run.stderr
    env["OMP_WAIT_POLICY"] = "passive"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "passive", run.stderr


def test_loading_the_kernels_keeps_subnormal_floats():
    # A -ffast-math link would switch the process to flush-to-zero when the library loads.
    fused_ops(torch.float32, torch.device("cpu"))
    decode_attention_kernel(torch.float32, 64, 3, torch.device("cpu"))
    blocked_linear_kernel(torch.float32, torch.device("cpu"))
    tiny = torch.tensor(1e-40, dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0
    assert float(np.float32(1e-40) * np.float32(1.0)) != 0.0
