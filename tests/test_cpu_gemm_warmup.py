"""Padded CPU step rows and the GEMM kernels an engine builds at start (engine.runner)."""

from __future__ import annotations

import pytest
import torch

from bulletserve import LLM, SamplingParams
from bulletserve.engine.config import EngineConfig
from bulletserve.engine.model_runner import builds_gemm_kernels, padded_rows, warm_cpu_gemms
from bulletserve.model.decoder import Linear
from bulletserve.perf.hardware import HardwareProfile


def test_rows_above_32_are_padded_to_a_multiple_of_16():
    assert [padded_rows(n) for n in (1, 17, 31, 32, 33, 48, 49, 250, 257)] == [
        1, 17, 31, 32, 48, 48, 64, 256, 272,
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_onednn_gemms_build_kernels_pytorchs_fp32_gemm_does_not(tiny_llama_dir, dtype):
    llm = LLM(model=str(tiny_llama_dir), dtype=dtype, max_model_len=64, cpu_warmup_rows=0)
    model, cpu = llm.engine.model, torch.device("cpu")
    # bf16 GEMMs are oneDNN's, packed or not; fp32 ones only when packed by oneDNN (else MKL's
    # or our blocked GEMM, whichever the load-time timing chose).
    packed = model.packed_linear
    expected = dtype == "bfloat16" or (packed is not None and packed.builds_per_row_count)
    assert builds_gemm_kernels(model, cpu) == expected == llm.engine.runner.pad_rows
    assert not builds_gemm_kernels(model, torch.device("cuda"))
    llm.engine.close()


def test_warmup_covers_every_padded_row_count_and_restores_the_thread_count(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16", max_model_len=64, cpu_warmup_rows=0)
    model = llm.engine.model
    # qkv, o, gate_up and down: four weight shapes, however many layers share them.
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert len({(m.in_features, m.out_features) for m in linears}) == 4 and len(linears) > 4
    before = torch.get_num_threads()
    # Rows 1-32 one by one, then 48: 33 row counts per layer weight; the LM head's 1-20.
    assert warm_cpu_gemms(model, 40, 20, [1, 2]) == 2 * (33 * 4 + 20)
    assert torch.get_num_threads() == before
    llm.engine.close()


@pytest.mark.parametrize(
    ("partition", "counts"), [("auto", [1, 2]), ("none", [2]), ("static:1/1", [1, 2])]
)
def test_a_two_lane_engine_warms_every_thread_count_a_lane_may_get(
    tiny_llama_dir, tmp_path, partition, counts
):
    # A given profile: measuring one at start runs bf16 GEMMs (20 s a test on 2 AMD Zen 3 vCPUs,
    # which have no native bf16).
    profile = tmp_path / "cpu.json"
    HardwareProfile("cpu", "cpu", True, 2, 1, 1, {"bfloat16": 4e11}, 4e10, 2, 1e-4).save(profile)
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="bfloat16",
        max_model_len=64,
        policy="bullet",
        num_threads=2,
        partition=partition,
        cpu_warmup_rows=40,
        hardware_profile=str(profile),
    )
    try:
        assert llm.engine.executor.thread_counts() == counts
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        # 36 prompt tokens: a padded prefill (48 rows) through the lanes.
        (out,) = llm.generate([[5, 6, 7] * 12], params)
        assert len(out.token_ids) == 3
    finally:
        llm.engine.close()


def test_a_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="--cpu-warmup-rows must be >= 0"):
        EngineConfig(cpu_warmup_rows=-1)
