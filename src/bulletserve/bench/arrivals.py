"""When requests are sent: Poisson or gamma arrivals at a mean rate, or a trace's own times.

As in vLLM's `benchmark_serving`: inter-arrival gaps are gamma distributed with shape
`burstiness` and mean 1/rate (burstiness 1 is a Poisson process; below 1 is burstier, above 1
more regular), and the cumulative times are rescaled so the last request is due at n/rate, which
removes the run-to-run spread of the total offered load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def interarrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """n gamma-distributed gaps with mean 1/rate and coefficient of variation 1/sqrt(burstiness)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests at a mean rate; all 0 for rate inf."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    times = np.cumsum(interarrival_gaps(n, rate, burstiness, seed))
    return (times * ((n / rate) / times[-1])).tolist()


def trace_arrival_times(timestamps: Sequence[float], rate: float) -> list[float]:
    """A trace's own arrival times, from its first request; rescaled to a mean rate unless inf."""
    if not timestamps:
        return []
    first = min(timestamps)
    times = [t - first for t in timestamps]
    span = max(times)
    if math.isinf(rate) or span == 0:
        return times
    factor = (len(times) / rate) / span
    return [t * factor for t in times]
