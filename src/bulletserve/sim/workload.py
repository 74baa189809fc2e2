"""The requests of one simulated run: the bench's dataset lengths and arrival times."""

from __future__ import annotations

from collections.abc import Sequence

from bulletserve.bench.arrivals import arrival_times, trace_arrival_times
from bulletserve.sim.request import SimRequest

Lengths = Sequence[tuple[int, int, float | None]]  # (input, output, trace timestamp)


def arrivals_for(
    lengths: Lengths, rate: float, burstiness: float, seed: int, trace: bool
) -> list[float]:
    """Arrival offsets exactly as `bullet bench` draws them for this rate and seed."""
    if trace:
        stamps = [t for _, _, t in lengths]
        if any(t is None for t in stamps):
            raise ValueError("--trace-arrivals: the dataset has no timestamps")
        return trace_arrival_times([t for t in stamps if t is not None], rate)
    return arrival_times(len(lengths), rate, burstiness, seed)


def make_requests(lengths: Lengths, arrivals: Sequence[float]) -> list[SimRequest]:
    return [
        SimRequest(f"req-{i}", i, t, input_len, output_len)
        for i, ((input_len, output_len, _), t) in enumerate(zip(lengths, arrivals, strict=True))
    ]
