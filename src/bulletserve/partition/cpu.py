"""CPU partitioning: a lane's units are intra-op threads of the OS thread that runs it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class CpuThreads:
    """Units are intra-op threads; `torch.set_num_threads` applies to the calling OS thread."""

    kind = "cpu"
    granularity = 1
    min_units = 1
    min_remainder = None  # any thread count may run beside another

    def __init__(self, total: int | None = None) -> None:
        self.total = total or usable_cores()
        self.device = torch.device("cpu")

    def prepare(self, counts: list[int]) -> None:
        """Nothing to create: a thread count is set when a lane starts its step."""

    @contextlib.contextmanager
    def lane(self, units: int, rest: bool = False) -> Iterator[None]:
        """Run the body on `units` threads (`rest`: on the threads the other lane left)."""
        previous = torch.get_num_threads()
        torch.set_num_threads(self.total - units if rest else units)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def synchronize(self) -> None:
        """CPU work is synchronous."""
