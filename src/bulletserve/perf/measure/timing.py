"""Wall-clock timing of device work."""

from __future__ import annotations

import time
from collections.abc import Callable


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
