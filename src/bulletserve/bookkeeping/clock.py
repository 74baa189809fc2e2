"""The clock an engine runs on: the wall clock when it serves (`RealClock`), or a virtual one
under test (`sim.clock.VirtualClock`), where the same engine threads take turns on simulated
time and each step lasts what the performance model says, so the engine's decisions can be
compared with the simulator's one for one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from bulletserve.bookkeeping.lane_core import LaneCore, LaneStep
from bulletserve.bookkeeping.single_step import SingleStep

T = TypeVar("T")


class Clock(Protocol):
    # Whether step times are measured (and so feed the performance model's online correction).
    measures: bool

    def now(self) -> float: ...

    def attach(self, core: LaneCore) -> None:
        """The laned engine's state machine, whose steps the clock times."""

    def enter(self, name: str) -> None:
        """The calling thread (an engine lane) starts running on this clock."""

    def leave(self) -> None:
        """The calling thread stops running on this clock."""

    def checkpoint(self) -> None:
        """A lane thread's turn begins (outside any lock)."""

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        """Wait on `cond` (held) until notified or `timeout` seconds pass."""

    def notify_all(self, cond: threading.Condition) -> None: ...

    def run_step(self, step: LaneStep, work: Callable[[], T]) -> tuple[T, float]:
        """Run a lane step's work; its result and the step's seconds."""
        ...

    def run_single(self, step: SingleStep, units: int, work: Callable[[], T]) -> tuple[T, float]:
        """Run a single-lane step's work on `units`; its result and the step's seconds."""
        ...


class RealClock:
    """The wall clock: monotonic time, real waits, steps timed as they run."""

    measures = True

    def now(self) -> float:
        return time.monotonic()

    def attach(self, core: LaneCore) -> None:
        pass

    def enter(self, name: str) -> None:
        pass

    def leave(self) -> None:
        pass

    def checkpoint(self) -> None:
        pass

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        cond.wait(timeout)

    def notify_all(self, cond: threading.Condition) -> None:
        cond.notify_all()

    def run_step(self, step: LaneStep, work: Callable[[], T]) -> tuple[T, float]:
        start = time.perf_counter()
        result = work()
        return result, time.perf_counter() - start

    def run_single(self, step: SingleStep, units: int, work: Callable[[], T]) -> tuple[T, float]:
        start = time.perf_counter()
        result = work()
        return result, time.perf_counter() - start
