"""What a number of the device's units do: peak GEMM rate and copy bandwidth per unit count,
and the quick device measure an engine takes at start when it has no hardware profile (the
rest of `bullet profile`, which drives the engine, is bulletserve.profiling)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulletserve.partition.cpu import CpuThreads
from bulletserve.partition.cuda import GreenContextSMs
from bulletserve.perf.fit import saturation_units
from bulletserve.perf.hardware import HardwareProfile, UnitPoint

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class MicroPlan:
    """Sizes of the micro-benchmarks and how many unit counts they sweep."""

    gemm_n: int
    bandwidth_bytes: int
    repeats: int
    max_unit_counts: int  # at most this many unit counts are swept (evenly spread)


QUICK = MicroPlan(gemm_n=1024, bandwidth_bytes=64 << 20, repeats=3, max_unit_counts=3)


def time_call(
    fn: Callable[[], object],
    sync: Callable[[], None],
    repeats: int,
    reduce: Callable[[list[float]], float] = min,
) -> float:
    """Fastest (or `reduce`) of `repeats` calls of `fn` after one warm-up call: on a machine
    shared with other work the fastest call is the one least disturbed by it, which is what a
    peak rate wants; a cost the engine pays at every step wants the typical call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return reduce(times)


def settle(device: torch.device) -> None:
    """Finish the default stream's work: a lane's stream does not wait for it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_rate(
    units: CpuThreads | GreenContextSMs, n: int, dtype: torch.dtype, count: int, repeats: int
) -> float:
    """FLOP/s of an n x n x n GEMM on `count` units."""
    a = torch.randn(n, n, device=units.device).to(dtype)
    b = torch.randn(n, n, device=units.device).to(dtype)
    out = torch.empty(n, n, device=units.device, dtype=dtype)
    settle(units.device)
    with units.lane(count):
        seconds = time_call(lambda: torch.mm(a, b, out=out), units.synchronize, repeats)
    return 2.0 * n**3 / seconds


def bandwidth(units: CpuThreads | GreenContextSMs, nbytes: int, count: int, repeats: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write) on `count` units."""
    src = torch.ones(nbytes // 4, device=units.device, dtype=torch.float32)
    dst = torch.empty_like(src)
    settle(units.device)
    with units.lane(count):
        seconds = time_call(lambda: dst.copy_(src), units.synchronize, repeats)
    return 2.0 * src.numel() * 4 / seconds


def bandwidth_corun(
    units: CpuThreads | GreenContextSMs,
    nbytes: int,
    count: int,
    gemm_n: int,
    repeats: int,
    dtype: torch.dtype,
) -> float:
    """Bytes/s of the copy on `count` units while a GEMM loop in `dtype` (the prefill's) keeps
    the other units busy: the bandwidth a decode lane sees next to a prefill."""
    a = torch.randn(gemm_n, gemm_n, device=units.device).to(dtype)
    settle(units.device)
    stop = threading.Event()
    started = threading.Event()

    def busy() -> None:
        with units.lane(count, rest=True):
            started.set()
            while not stop.is_set():
                torch.mm(a, a)
                units.synchronize()

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        started.wait()
        return bandwidth(units, nbytes, count, repeats)
    finally:
        stop.set()
        thread.join()


def unit_counts(valid: list[int], limit: int) -> list[int]:
    """At most `limit` of the valid counts, spread evenly, always with the smallest and all."""
    if len(valid) <= limit:
        return valid
    step = (len(valid) - 1) / (limit - 1)
    return sorted({valid[round(i * step)] for i in range(limit)})


def micro_sizes(plan: MicroPlan, kind: str) -> tuple[int, int]:
    """(GEMM n, copy bytes) for the micro-benchmarks. A GPU needs larger ones than the plans'
    CPU-sized defaults: on an H200 a 1024^3 GEMM measured 64-102 TFLOP/s where 8192^3 gave
    793, and a 64 MB copy (about its 60 MB L2) 2.9 TB/s where the device's notes give 4.3 TB/s
    for an 8.6 GB copy."""
    if kind == "gpu":
        return max(plan.gemm_n, 8192), max(plan.bandwidth_bytes, 2 << 30)
    return plan.gemm_n, plan.bandwidth_bytes


def measure_device(
    units: CpuThreads | GreenContextSMs,
    plan: MicroPlan,
    name: str,
    log: Callable[[str], None],
    dtype: torch.dtype,
) -> HardwareProfile:
    """Peaks, N_d and the unit sweep; no step calibration yet. The GEMMs run in `dtype`, the
    one the model computes in and the calibration is fitted for, and the profile holds that
    dtype's peak only: others would cost time for nothing calibrated (on a CPU without native
    bf16 a 1024^3 bf16 `torch.mm` ran at 0.9 GFLOP/s against 129 in fp32, see
    model.loader.cpu_has_native_bf16)."""
    gran, min_units = units.granularity, units.min_units
    skeleton = HardwareProfile(
        name, units.kind, True, units.total, gran, min_units, {"float32": 1.0}, 1.0, 1, 0.0
    )
    counts = unit_counts(skeleton.valid_units(), plan.max_unit_counts)
    gemm_n, nbytes = micro_sizes(plan, units.kind)
    sweep = []
    for c in counts:
        rate = gemm_rate(units, gemm_n, dtype, c, plan.repeats)
        bw = bandwidth(units, nbytes, c, plan.repeats)
        sweep.append(UnitPoint(c, rate, bw))
        log(
            f"  {c:>4} units: GEMM {rate / 1e9:9.1f} GFLOP/s ({DTYPE_NAMES[dtype]}), "
            f"copy {bw / 1e9:7.1f} GB/s"
        )
    return dataclasses.replace(
        skeleton,
        peak_flops={DTYPE_NAMES[dtype]: sweep[-1].gemm_flops},  # the sweep ends on every unit
        peak_bandwidth=max(p.bandwidth for p in sweep),
        bandwidth_saturation_units=saturation_units(sweep),
        gemm_tile=(128, 128) if units.kind == "gpu" else None,
        calibration=dataclasses.replace(skeleton.calibration, unit_sweep=tuple(sweep)),
    )
