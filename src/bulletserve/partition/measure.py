"""Micro-benchmarks: peak GEMM rate and memory bandwidth on a given number of units."""

from __future__ import annotations

import statistics
import threading

import torch

from bulletserve.engine.request import Request, RequestTimings
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.sampling_params import SamplingParams
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


def sampling_cost(
    units: CpuThreads | GreenContextSMs, vocab: int, rows: int, count: int, repeats: int
) -> float:
    """Seconds per logit (row x vocabulary entry) of the engine's sampler on `count` units, at
    temperature 1 (what a request that sets none gets), over `rows` rows of float32 logits: the
    median call, since the engine pays the typical call at every step."""
    logits = torch.randn(rows, vocab, device=units.device)
    requests = [
        Request(f"sample-{i}", None, [0], SamplingParams(temperature=1.0), RequestTimings(0.0))
        for i in range(rows)
    ]
    sampler = Sampler(0)
    stop_ids = [frozenset()] * rows
    _settle(units.device)
    with units.lane(count):
        seconds = time_call(
            lambda: sampler.sample(logits, requests, stop_ids),
            units.synchronize,
            repeats,
            statistics.median,
        )
    return seconds / (rows * vocab)
