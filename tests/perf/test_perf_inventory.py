"""Op inventory FLOPs and bytes against a hand count on the `tiny` preset."""

from __future__ import annotations

import pytest

from bulletserve.model.presets import PRESETS
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.inventory import decode_counts, prefill_counts, step_ops

TINY = PRESETS["tiny"]  # h=64, i=128, 2 layers, 4 heads, 2 kv heads, head_dim 16, vocab 49152
D = 2  # bf16


def _by_name(ops):
    return {op.name: op for op in ops}


def test_counts():
    # 3 new tokens on a 2-token cached prefix: pairs 3*2 + (1+2+3) = 12, K/V read 5.
    assert prefill_counts((3,), (2,)) == (3, 12, 5, 1)
    assert prefill_counts((3, 4), ()) == (7, 6 + 10, 7, 2)
    assert decode_counts((5, 7)) == (2, 12, 12, 2)


def test_prefill_hand_count():
    es = ExecutionState(prefill_lens=(3,), prefill_cached=(2,), prefill_units=1)
    ops = _by_name(step_ops(TINY, es, "prefill", D))
    # q=64, kv=32: qkv is a 3x64 @ 64x128 GEMM.
    assert ops["qkv_proj"].flops == 2 * 3 * 64 * 128
    assert ops["qkv_proj"].bytes == (64 * 128 + 3 * 64 + 3 * 128) * D
    assert (ops["qkv_proj"].gemm_m, ops["qkv_proj"].gemm_n) == (3, 128)
    assert ops["o_proj"].flops == 2 * 3 * 64 * 64
    assert ops["o_proj"].bytes == (64 * 64 + 3 * 64 + 3 * 64) * D
    assert ops["gate_up_proj"].flops == 2 * 3 * 64 * 256
    assert ops["gate_up_proj"].bytes == (64 * 256 + 3 * 64 + 3 * 256) * D
    assert ops["down_proj"].flops == 2 * 3 * 128 * 64
    assert ops["down_proj"].bytes == (128 * 64 + 3 * 128 + 3 * 64) * D
    # Attention: 12 pairs x 4 heads x (QK^T + PV = 4 * head_dim); read Q, write O and new K/V,
    # read K/V of all 5 positions.
    assert ops["attention"].flops == 4 * 16 * 4 * 12
    assert ops["attention"].bytes == 3 * (2 * 64 + 2 * 32) * D + 5 * 2 * 32 * D
    assert ops["input_norm"].flops == 4 * 3 * 64
    assert ops["input_norm"].bytes == 2 * 3 * 64 * D + 64 * D
    assert ops["rope"].flops == 3 * 3 * (64 + 32)
    assert ops["embedding"].bytes == 2 * 3 * 64 * D and ops["embedding"].flops == 0
    # LM head and sampler see only the last position.
    assert ops["lm_head"].flops == 2 * 64 * 49152
    assert ops["lm_head"].bytes == (64 * 49152 + 64 + 49152) * D
    assert ops["sampling"].flops == 5 * 49152
    assert ops["sampling"].bytes == 49152 * 4
    assert ops["qkv_proj"].repeat == 2 and ops["lm_head"].repeat == 1


def test_decode_hand_count():
    es = ExecutionState(decode_ctx=(5, 7), decode_units=1)
    ops = _by_name(step_ops(TINY, es, "decode", D))
    assert ops["qkv_proj"].flops == 2 * 2 * 64 * 128
    assert ops["attention"].flops == 4 * 16 * 4 * 12
    assert ops["attention"].bytes == 2 * (2 * 64 + 2 * 32) * D + 12 * 2 * 32 * D
    assert ops["lm_head"].flops == 2 * 2 * 64 * 49152


def test_dtype_and_optional_ops():
    es = ExecutionState(prefill_lens=(4,), prefill_units=1)
    bf16 = _by_name(step_ops(TINY, es, "prefill", 2))
    fp32 = _by_name(step_ops(TINY, es, "prefill", 4))
    assert fp32["down_proj"].bytes == 2 * bf16["down_proj"].bytes
    assert fp32["down_proj"].flops == bf16["down_proj"].flops
    assert "qk_norm" not in bf16
    qwen = _by_name(step_ops(PRESETS["qwen3-8b"], es, "prefill", 2))
    assert qwen["qk_norm"].flops == 4 * 4 * (4096 + 1024)


def test_layer_slice_of_prefill():
    cfg = PRESETS["smollm2-135m"]  # 30 layers
    mid = ExecutionState(
        prefill_lens=(8,), prefill_units=1, prefill_layers=10, prefill_first_layer=10
    )
    names = _by_name(step_ops(cfg, mid, "prefill", 2))
    assert names["qkv_proj"].repeat == 10
    assert "embedding" not in names and "lm_head" not in names
    tail = ExecutionState(
        prefill_lens=(8,), prefill_units=1, prefill_layers=10, prefill_first_layer=20
    )
    assert "lm_head" in _by_name(step_ops(cfg, tail, "prefill", 2))


def test_idle_phase_and_bad_phase():
    assert step_ops(TINY, ExecutionState(), "decode", 2) == []
    with pytest.raises(ValueError, match="phase"):
        step_ops(TINY, ExecutionState(), "both", 2)
