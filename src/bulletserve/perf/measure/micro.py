"""Micro-benchmarks: peak GEMM rate and memory bandwidth on a given number of units."""

from __future__ import annotations

import threading

import torch

from bulletserve.partition import CpuThreads, GreenContextSMs
from bulletserve.perf.measure.timing import time_call


def _settle(device: torch.device) -> None:
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
    _settle(units.device)
    with units.lane(count):
        seconds = time_call(lambda: torch.mm(a, b, out=out), units.synchronize, repeats)
    return 2.0 * n**3 / seconds


def bandwidth(units: CpuThreads | GreenContextSMs, nbytes: int, count: int, repeats: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write) on `count` units."""
    src = torch.ones(nbytes // 4, device=units.device, dtype=torch.float32)
    dst = torch.empty_like(src)
    _settle(units.device)
    with units.lane(count):
        seconds = time_call(lambda: dst.copy_(src), units.synchronize, repeats)
    return 2.0 * src.numel() * 4 / seconds


def bandwidth_corun(
    units: CpuThreads | GreenContextSMs, nbytes: int, count: int, gemm_n: int, repeats: int
) -> float:
    """Bytes/s of the copy on `count` units while a GEMM loop keeps the other units busy: the
    bandwidth a decode lane sees next to a prefill."""
    a = torch.randn(gemm_n, gemm_n, device=units.device).to(torch.bfloat16)
    _settle(units.device)
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
