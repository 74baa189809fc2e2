"""P90 normalized TTFT and TPOT over recent finished requests: what Bullet's scheduler sees.

The same statistic as the laned engine's `LatencyWindow` (`engine/lanes.py`), over simulated
requests; that module imports torch, which the simulator does not load.
"""

from __future__ import annotations

from collections import deque

from bulletserve.sched.bullet import LatencyStats
from bulletserve.sim.request import SimRequest

STATS_WINDOW = 64  # as engine/lanes.py


class SimLatencyWindow:
    def __init__(self) -> None:
        self.ttft_per_token: deque[float] = deque(maxlen=STATS_WINDOW)
        self.tpot: deque[float] = deque(maxlen=STATS_WINDOW)

    def add(self, request: SimRequest) -> None:
        times = request.token_times
        if not times or request.finished_at is None:
            return
        self.ttft_per_token.append((times[0] - request.arrival) / request.input_len)
        if len(times) > 1:
            self.tpot.append((request.finished_at - times[0]) / (len(times) - 1))

    def stats(self) -> LatencyStats:
        return LatencyStats(_p90(self.ttft_per_token), _p90(self.tpot))


def _p90(values: deque[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
