"""The performance model under tensor parallelism: one rank's roofline plus its collectives."""

from __future__ import annotations

import pytest

from bulletserve.model.presets import get_preset
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import load_preset
from bulletserve.perf.model import AllReduceTime, PerfModel
from bulletserve.sim.device_presets import GIB, kv_cache_blocks, weight_bytes

LLAMA_70B = get_preset("llama-3.1-70b")
A100 = load_preset("a100-80gb")


def test_a_rank_computes_its_share_and_pays_two_all_reduces_a_layer():
    es = ExecutionState(decode_ctx=(1024,) * 64, decode_units=A100.units)
    one = PerfModel(LLAMA_70B, A100)
    eight = PerfModel(LLAMA_70B, A100, tensor_parallel_size=8)
    # Decode is bound by reading weights and KV: a rank reads about an eighth of them (its
    # narrower GEMMs fill fewer tiles, so a little more than an eighth of the time).
    assert 0.125 < eight.roofline(es, "decode") / one.roofline(es, "decode") < 0.2
    hidden_bytes = 64 * LLAMA_70B.hidden_size * 2
    all_reduce = AllReduceTime(A100.calibration.all_reduce_s[8])
    logits_bytes = 64 * LLAMA_70B.vocab_size * 4 / 8
    expected = 2 * LLAMA_70B.num_layers * all_reduce(hidden_bytes) + all_reduce(logits_bytes)
    counts = (64.0, 64.0 * 1024, 64.0 * 1024, 64.0)
    assert eight.communication_s(es, "decode", counts) == pytest.approx(expected)
    predicted = eight.predict(es).decode_s
    alpha = eight.alpha(es, "decode")
    assert predicted == pytest.approx(alpha * eight.roofline(es, "decode") + expected)


def test_a_prefill_layer_group_pays_only_its_layers_collectives():
    model = PerfModel(LLAMA_70B, A100, tensor_parallel_size=4)
    es = ExecutionState(
        prefill_lens=(512,), prefill_units=A100.units, prefill_first_layer=0, prefill_layers=10
    )
    all_reduce = AllReduceTime(A100.calibration.all_reduce_s[4])
    counts = (512.0, 512 * 513 / 2, 512.0, 1.0)
    assert model.communication_s(es, "prefill", counts) == pytest.approx(
        20 * all_reduce(512 * LLAMA_70B.hidden_size * 2)
    )


def test_all_reduce_time_is_bandwidth_bound_past_the_largest_measured_message():
    time = AllReduceTime(((1e3, 1e-5), (1e6, 1e-4)))
    assert time(10.0) == 1e-5
    assert time(5.005e5) == pytest.approx(5.5e-5)
    assert time(4e6) == pytest.approx(4e-4)


def test_a_profile_without_all_reduce_times_for_the_ranks_is_refused():
    with pytest.raises(ValueError, match="no all-reduce times for 8 ranks"):
        PerfModel(LLAMA_70B, load_preset("h200"), tensor_parallel_size=8)
    with pytest.raises(ValueError, match="does not divide the model's 64 attention heads"):
        PerfModel(LLAMA_70B, A100, tensor_parallel_size=3)


def test_each_device_holds_its_share_of_weights_and_kv():
    per_rank = weight_bytes(LLAMA_70B, "bfloat16", 8)
    embedding = LLAMA_70B.vocab_size * LLAMA_70B.hidden_size * 2
    assert per_rank == pytest.approx(
        (weight_bytes(LLAMA_70B, "bfloat16") - embedding) / 8 + embedding
    )
    blocks = kv_cache_blocks(LLAMA_70B, "bfloat16", 16, 80 * GIB, 0.9, 8)
    kv_per_block = 2 * LLAMA_70B.num_layers * (LLAMA_70B.kv_size // 8) * 2 * 16
    assert blocks == int((0.9 * 80 * GIB - per_rank) // kv_per_block)
