"""Wall-clock timing of device work."""

from __future__ import annotations

import time
from collections.abc import Callable


def time_call(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """Fastest of `repeats` calls of `fn` after one warm-up call: on a machine shared with other
    work the fastest call is the one least disturbed by it."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)
