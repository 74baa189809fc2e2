"""`bullet profile`: measure a device, sweep real steps, fit the model, build a profile."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bulletserve.engine.engine import LLMEngine
from bulletserve.model.decoder import DecoderLM
from bulletserve.partition import CpuThreads, GreenContextSMs
from bulletserve.partition.measure import (
    DTYPE_NAMES,
    QUICK,
    MicroPlan,
    bandwidth_corun,
    measure_device,
    micro_sizes,
)
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.fit import StepSample, calibrate
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.profiling.host import outside_runner_s, sampling_cost
from bulletserve.profiling.steps import StepBench

SAMPLING_ROWS = 64  # rows of logits the sampler's cost is measured on
SAMPLING_REPEATS = 9  # calls the sampler's median cost is taken over (64 rows: ~6 ms a call)


@dataclass(frozen=True)
class SweepPlan:
    micro: MicroPlan  # the GEMM and copy micro-benchmarks per unit count
    # Down to chat-sized prompts (half of sharegpt-like's are under 32 tokens, a fifth under
    # 16), which the alpha surface would otherwise extrapolate by clamping below its first
    # point.
    prefill_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    # Each against the middle decode shape; down to the shortest prefill_lens, since a short
    # prompt's alpha is not a long one's (the alpha surface clamps below its first point).
    corun_prefill_lens: tuple[int, ...]
    corun_decode_batches: tuple[int, ...]  # each against the middle prefill length
    repeats: int
    host_tokens: int  # tokens decoded at each of decode_batches to time the engine's host work

    @property
    def max_tokens(self) -> int:
        decode = max(self.decode_batches + self.corun_decode_batches) * max(self.decode_contexts)
        return max(self.prefill_lens + self.corun_prefill_lens) + decode


PLANS = {
    "default": SweepPlan(
        micro=MicroPlan(gemm_n=2048, bandwidth_bytes=256 << 20, repeats=5, max_unit_counts=6),
        prefill_lens=(8, 32, 128, 512, 1024, 2048),
        decode_batches=(1, 4, 16, 32, 64),
        decode_contexts=(128, 512, 1024),
        corun_prefill_lens=(8, 32, 128, 512, 2048),
        corun_decode_batches=(1, 4, 16, 64),
        repeats=3,
        host_tokens=32,
    ),
    "quick": SweepPlan(
        micro=QUICK,  # what an engine without a profile measures at start
        prefill_lens=(16, 64, 256, 1024),
        decode_batches=(1, 8, 32),
        decode_contexts=(256,),
        corun_prefill_lens=(16, 64, 256, 1024),
        corun_decode_batches=(1, 8, 32),
        repeats=2,
        host_tokens=16,
    ),
}


def _es_prefill(lens: tuple[int, ...], units: int) -> ExecutionState:
    return ExecutionState(prefill_lens=lens, prefill_units=units)


def _es_decode(batch: int, context: int, units: int) -> ExecutionState:
    return ExecutionState(decode_ctx=(context,) * batch, decode_units=units)


def plan_states(plan: SweepPlan, counts: list[int], total: int) -> list[ExecutionState]:
    """The plan's prefill and decode shapes alone at each unit count, then its co-running
    cross at each split: every co-running prefill length against the middle decode batch, and
    the middle length against every co-running batch (the fit's reference arms)."""
    states = []
    for c in counts:
        states += [_es_prefill((n,), c) for n in plan.prefill_lens]
        states += [
            _es_decode(b, ctx, c) for b in plan.decode_batches for ctx in plan.decode_contexts
        ]
    mid_len = plan.corun_prefill_lens[len(plan.corun_prefill_lens) // 2]
    mid_batch = plan.corun_decode_batches[len(plan.corun_decode_batches) // 2]
    ctx = plan.decode_contexts[len(plan.decode_contexts) // 2]
    pairs = {(n, mid_batch) for n in plan.corun_prefill_lens}
    pairs |= {(mid_len, b) for b in plan.corun_decode_batches}
    for p in [c for c in counts if c < total]:
        states += [
            ExecutionState(
                prefill_lens=(n,), prefill_units=p, decode_ctx=(ctx,) * b, decode_units=total - p
            )
            for n, b in sorted(pairs)
        ]
    return states


@dataclass(frozen=True)
class ProfileRun:
    """A fitted profile, the step samples it was fitted to, and the samples of the extra
    (held-out) states measured in the same rounds but not fitted."""

    hw: HardwareProfile
    samples: list[StepSample]
    held_out: list[StepSample]


def profile_device(
    model: DecoderLM,
    units: CpuThreads | GreenContextSMs,
    plan: SweepPlan,
    name: str,
    log: Callable[[str], None],
    held_out: Sequence[ExecutionState] = (),
) -> ProfileRun:
    """Measure, sweep and fit. `held_out` states are timed in the same rounds as the plan's (so
    that both see the same machine) and left out of the fit."""
    torch_dtype = next(model.parameters()).dtype
    dtype = DTYPE_NAMES[torch_dtype]
    log("peak GEMM rate and copy bandwidth per unit count:")
    hw = measure_device(units, plan.micro, name, log, torch_dtype)
    counts = [p.units for p in hw.calibration.unit_sweep]
    gemm_n, nbytes = micro_sizes(plan.micro, units.kind)
    bw_corun = tuple(
        (float(c), bandwidth_corun(units, nbytes, c, gemm_n, plan.micro.repeats, torch_dtype))
        for c in counts
        if c < units.total
    )
    max_tokens = max(
        [plan.max_tokens] + [es.prefill_tokens + sum(es.decode_ctx) for es in held_out]
    )
    bench = StepBench(model, units, max_tokens)
    hw = dataclasses.replace(hw, step_overhead_s=bench.prepare_overhead(20))
    states = plan_states(plan, counts, units.total)
    log(
        f"step sweeps through the model runner: {len(states)} states"
        + (f" and {len(held_out)} held out" if held_out else "")
        + f", {plan.repeats} rounds"
    )
    measured = bench.measure(states + list(held_out), plan.repeats)
    fitted = len(states) + sum(es.has_prefill and es.has_decode for es in states)
    samples = measured[:fitted]
    # The step sweeps time the model only; the engine samples every row that reaches the LM
    # head as well (on the CPU, 12 ms for 160 rows of a 49K vocabulary on two threads).
    sampling = tuple(
        (
            float(c),
            sampling_cost(units, model.config.vocab_size, SAMPLING_ROWS, c, SAMPLING_REPEATS),
        )
        for c in counts
    )
    log("sampler per logit: " + ", ".join(f"{c:.0f} units {s * 1e9:.2f} ns" for c, s in sampling))
    hw = calibrate(model.config, hw, dtype, samples, bw_corun)
    hw = dataclasses.replace(
        hw, calibration=dataclasses.replace(hw.calibration, sampling_s_per_logit=sampling)
    )
    return ProfileRun(hw, samples, measured[fitted:])


def profile_host(
    hw: HardwareProfile,
    engine: LLMEngine,
    units: CpuThreads | GreenContextSMs,
    plan: SweepPlan,
    log: Callable[[str], None],
) -> HardwareProfile:
    """`hw` with the engine's host time per step: a decode step's time outside the model runner
    on `engine`, at the plan's decode batch sizes on every unit, less what `hw`'s sampler costs
    predict for it, fitted as a cost per step plus one per row. The sampler's own cost keeps its
    dependence on the units a lane has; the host terms take whatever it misses at these rows."""
    points = outside_runner_s(engine, plan.decode_batches, plan.host_tokens, units.synchronize)
    per_logit = dict(hw.calibration.sampling_s_per_logit).get(float(hw.units), 0.0)
    vocab = engine.model_config.vocab_size
    rows = [r for r, _ in points]
    host = [seconds - r * vocab * per_logit for r, seconds in points]
    per_row, per_step = (float(c) for c in np.polyfit(rows, host, 1))
    log(
        "engine time outside the runner per decode step: "
        + ", ".join(f"{r} rows {s * 1e3:.2f} ms" for r, s in points)
        + f"; host beyond the sampler {max(per_step, 0) * 1e3:.2f} ms"
        + f" + {max(per_row, 0) * 1e3:.3f} ms a row"
    )
    calibration = dataclasses.replace(
        hw.calibration, host_s_per_step=max(per_step, 0.0), host_s_per_row=max(per_row, 0.0)
    )
    return dataclasses.replace(hw, calibration=calibration)
