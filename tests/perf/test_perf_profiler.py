"""`bullet profile` end to end on the tiny dummy model with a very small sweep."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bulletserve.cli import main
from bulletserve.model.loader import load_model
from bulletserve.model.source import resolve_model
from bulletserve.partition import CpuThreads, GreenContextSMs, UnitsUnavailableError
from bulletserve.partition.measure import MicroPlan, measure_device, unit_counts
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.hardware import Calibration, HardwareProfile
from bulletserve.perf.model import PerfModel
from bulletserve.profiling.profiler import PLANS, profile_device

TINY_PLAN = dataclasses.replace(
    PLANS["quick"],
    micro=MicroPlan(gemm_n=128, bandwidth_bytes=1 << 20, repeats=1, max_unit_counts=3),
    prefill_lens=(8, 32),
    decode_batches=(1, 4),
    decode_contexts=(16,),
    corun_prefill_lens=(32,),
    corun_decode_batches=(2,),
    repeats=1,
)


def test_unit_counts_spread():
    assert unit_counts([1, 2], 6) == [1, 2]
    assert unit_counts(list(range(8, 136, 8)), 4) == [8, 48, 88, 128]


def test_a_device_measured_for_an_engine_runs_and_holds_only_its_dtype():
    lines = []
    hw = measure_device(CpuThreads(), TINY_PLAN.micro, "at-start", lines.append, torch.float32)
    assert set(hw.peak_flops) == {"float32"}
    assert hw.peak_flops["float32"] == hw.calibration.unit_sweep[-1].gemm_flops
    assert all("(float32)" in line for line in lines)


def test_profile_tiny_model(tmp_path):
    model = load_model(resolve_model("tiny", "dummy"), torch.float32, torch.device("cpu"), 64)
    lines = []
    total = CpuThreads().total
    held_out = [
        ExecutionState(prefill_lens=(12, 5), prefill_units=1),
        ExecutionState(decode_ctx=(20, 9, 30), decode_units=total),
    ]
    if total > 1:
        held_out.append(
            ExecutionState(
                prefill_lens=(7,), prefill_units=1, decode_ctx=(11,), decode_units=total - 1
            )
        )
    with torch.inference_mode():
        run = profile_device(model, CpuThreads(), TINY_PLAN, "test-cpu", lines.append, held_out)
    hw, samples = run.hw, run.samples
    # Held-out states come back in order (two samples for a co-running one), and unfitted.
    expected = [("prefill", False), ("decode", False), ("prefill", True), ("decode", True)]
    assert [(s.phase, s.corun) for s in run.held_out] == expected[: len(run.held_out)]
    assert len(run.held_out) == (4 if total > 1 else 2)
    assert [s.es for s in run.held_out][:2] == held_out[:2]
    assert all(s.measured_s > 0 for s in run.held_out)
    assert not {s.es for s in run.held_out} & {s.es for s in samples}
    assert hw.measured and hw.kind == "cpu" and hw.units == CpuThreads().total
    assert set(hw.peak_flops) == {"float32"}  # the dtype it was profiled in, as calibrated
    assert 1 <= hw.bandwidth_saturation_units <= hw.units
    assert {"prefill", "decode"} <= set(hw.calibration.alpha)
    path = tmp_path / "p.json"
    hw.save(path)
    assert HardwareProfile.load(path) == hw
    # The sampler is timed on every unit count swept; the step samples time the model alone.
    counts = [p.units for p in hw.calibration.unit_sweep]
    assert [u for u, _ in hw.calibration.sampling_s_per_logit] == counts
    assert all(s > 0 for _, s in hw.calibration.sampling_s_per_logit)
    # The fitted model reproduces an alone sample it was fitted to, plus the sampler's time.
    model_ = PerfModel(model.config, hw, "float32")
    sample = next(s for s in samples if s.phase == "prefill" and not s.corun)
    es = ExecutionState(prefill_lens=sample.es.prefill_lens, prefill_units=sample.units)
    sampler_s = model_.sampling_s(es, "prefill")
    assert sampler_s > 0
    assert model_.predict(es).prefill_s == pytest.approx(sample.measured_s + sampler_s, rel=1e-6)


def test_the_step_bench_writes_its_whole_kv_pool_before_timing_anything():
    # Blocks go out first-in first-out: a decode state's context would otherwise sit on pages
    # no step had written, faulted in (or read as the zero page) inside the timed call.
    import psutil

    from bulletserve.profiling.steps import StepBench

    model = load_model(resolve_model("tiny", "dummy"), torch.float32, torch.device("cpu"), 64)
    per_token = model.config.kv_bytes_per_token(4)
    process = psutil.Process()
    before = process.memory_info().rss
    bench = StepBench(model, CpuThreads(), max_tokens=(64 << 20) // per_token)
    pool_bytes = bench.pool.kv.numel() * bench.pool.kv.element_size()
    # Resident, not merely reserved: a pool left as torch.empty would add almost nothing.
    assert process.memory_info().rss - before > 0.9 * pool_bytes
    assert not bench.pool.kv.any()


def test_green_contexts_fail_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(UnitsUnavailableError, match="CUDA is not available"):
        GreenContextSMs(torch.device("cuda"))


def test_cli_rejects_cuda_without_it(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert main(["profile", "--device", "cuda", "--quick"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_a_count_off_the_granularity_is_carved_as_the_remainder_beside_its_complement():
    from bulletserve.partition.cuda import carve_for

    assert carve_for(64, 132, 8) == 64  # a multiple of 8: carved itself
    assert carve_for(124, 132, 8) == 8  # the 124 SMs left beside a carved 8
    assert carve_for(100, 132, 8) == 32
    for bad in (66, 132, 0):  # neither 66 nor 66 beside it; the whole GPU; nothing
        with pytest.raises(UnitsUnavailableError):
            carve_for(bad, 132, 8)


def test_gpu_micro_benchmarks_are_sized_past_launch_overhead_and_l2():
    from bulletserve.partition.measure import QUICK, micro_sizes

    quick = QUICK
    assert micro_sizes(quick, "cpu") == (quick.gemm_n, quick.bandwidth_bytes)
    gemm_n, nbytes = micro_sizes(quick, "gpu")
    assert gemm_n >= 8192 and nbytes >= 1 << 30


def test_every_plan_times_chat_sized_prompts():
    """Half of sharegpt-like's prompts are under 32 tokens, a fifth under 16: the profile
    measures them rather than clamp the alpha surface below its first point."""
    from bulletserve.profiling.profiler import PLANS

    for name, plan in PLANS.items():
        assert min(plan.prefill_lens) <= 16, name


def test_every_plan_times_co_running_prefills_as_short_as_its_shortest_prompt():
    """The co-running alpha surface clamps below its first point; on the CPU a 64-token prefill
    beside a decode ran at about twice the 256-token alpha, so a plan that started at 256
    predicted short prompts' co-running prefills faster than the same prompt alone."""
    from bulletserve.profiling.profiler import PLANS, plan_states

    for name, plan in PLANS.items():
        assert min(plan.corun_prefill_lens) <= min(plan.prefill_lens), name
        co_running = [es for es in plan_states(plan, [1, 2], 2) if es.has_decode and es.has_prefill]
        assert min(es.prefill_tokens for es in co_running) == min(plan.prefill_lens), name


def test_host_cost_is_measured_on_a_real_engine():
    """The engine's time outside the runner, per decode step of each plan batch size, less the
    profile's sampler: host terms that are never negative, and an engine left as it was."""
    from bulletserve.engine.config import EngineConfig
    from bulletserve.engine.engine import LLMEngine
    from bulletserve.profiling.host import PROMPT_TOKENS, outside_runner_s
    from bulletserve.profiling.profiler import profile_host

    plan = dataclasses.replace(TINY_PLAN, decode_batches=(1, 4), host_tokens=8)
    source = resolve_model("tiny", "dummy")
    model = load_model(source, torch.float32, torch.device("cpu"), 128)
    config = EngineConfig(
        model="tiny",
        load_format="dummy",
        dtype="float32",
        device="cpu",
        policy="prefill-first",
        max_num_seqs=4,
        max_model_len=PROMPT_TOKENS + plan.host_tokens + 16,
    )
    engine = LLMEngine(config, model=model)
    assert engine.model is model
    units = CpuThreads()
    points = outside_runner_s(engine, plan.decode_batches, plan.host_tokens, units.synchronize)
    assert [rows for rows, _ in points] == [1, 4]
    assert all(0 < seconds < 1 for _, seconds in points)
    assert "execute" not in vars(engine.runner) and not engine.has_unfinished()
    assert engine.pool.allocator.num_free == engine.pool.allocator.num_blocks
    hw = HardwareProfile(
        name="test-cpu",
        kind="cpu",
        measured=True,
        units=units.total,
        unit_granularity=1,
        min_units=1,
        peak_flops={"float32": 1e11},
        peak_bandwidth=1e10,
        bandwidth_saturation_units=1,
        step_overhead_s=0.0,
        calibration=Calibration(sampling_s_per_logit=((float(units.total), 1e-9),)),
    )
    with torch.inference_mode():
        measured = profile_host(hw, engine, units, plan, lambda line: None)
    cal = measured.calibration
    assert cal.host_s_per_step >= 0 and cal.host_s_per_row >= 0
    assert cal.host_s_per_step + cal.host_s_per_row > 0
    assert cal.sampling_s_per_logit == hw.calibration.sampling_s_per_logit
    with pytest.raises(ValueError, match="output tokens"):
        outside_runner_s(engine, (1, 2), 3, units.synchronize)
