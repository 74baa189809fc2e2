"""A virtual clock for the real engine (the protocol it keeps: bookkeeping/clock.py): its threads
(a driver adding requests, the two lanes) take turns on simulated time, one at a time, and each
step lasts what the modeled device says (`sim.device.ModeledLanes` for lane steps, the
prediction for a single-lane step), so the engine's decisions can be compared with the
simulator's one for one.

At one instant the threads run in the simulator's order: lanes whose steps ended (prefill
first), then the driver (arrivals), then lanes that were woken or take their next turn (prefill
first). Time advances only when every thread waits: to the earliest step end, wake-up or sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from bulletserve.bookkeeping.lane_core import LaneCore, LaneStep
from bulletserve.bookkeeping.single_step import SingleStep
from bulletserve.sim.device import CachedPerfModel, ModeledLanes, Noise, time_single_step

T = TypeVar("T")

# Turn order at one instant: a step's end, then the driver, then a lane's next turn.
STEP_END, DRIVER, TURN = 0, 1, 2
RANKS = {"prefill": 0, "decode": 1}


@dataclass
class _Thread:
    name: str
    runnable: int | None = None  # the class it may run in, None while it waits
    wake_at: float | None = None  # a wait's or a sleep's deadline
    waiting: bool = False  # in `wait`, so a notify wakes it
    wake_class: int = TURN


class VirtualClock:
    measures = False  # a modeled step has no measurement to feed the online correction

    def __init__(self, perf: CachedPerfModel, noise: Noise) -> None:
        self.perf, self.noise = perf, noise
        self.time = 0.0
        self.lanes: ModeledLanes | None = None
        self._lock = threading.Condition()
        self._threads: dict[int, _Thread] = {}
        self._holder: int | None = None  # the thread that runs now
        self._stepping: dict[str, int] = {}  # lane -> thread whose step is on the device

    def await_threads(self, count: int, timeout_s: float = 30.0) -> None:
        """Block (on the wall clock) until `count` threads have entered, so that threads that
        start in the background join at a known instant."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._threads) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._threads)} of {count} threads entered the clock")
                self._lock.wait(left)

    # ---- the Clock interface ------------------------------------------------------------------

    def now(self) -> float:
        return self.time

    def attach(self, core: LaneCore) -> None:
        self.lanes = ModeledLanes(core, self.perf, self.noise)

    def enter(self, name: str) -> None:
        """Join the clock; return once it is this thread's turn."""
        me = threading.get_ident()
        with self._lock:
            self._threads[me] = _Thread(name, runnable=DRIVER if name == "driver" else TURN)
            self._lock.notify_all()
            if self._holder is None:
                self._pass_turn()
            self._await_turn(me)

    def leave(self) -> None:
        me = threading.get_ident()
        with self._lock:
            del self._threads[me]
            if self._holder == me:
                self._holder = None
                self._pass_turn()

    def checkpoint(self) -> None:
        self._yield(TURN)

    def sleep_until(self, when: float) -> None:
        """The driver waits for simulated time `when`."""
        me = threading.get_ident()
        with self._lock:
            thread = self._threads[me]
            thread.runnable, thread.wake_at, thread.wake_class = None, max(when, self.time), DRIVER
            self._pass_turn()
            self._await_turn(me)

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        me = threading.get_ident()
        with self._lock:
            thread = self._threads[me]
            thread.runnable, thread.waiting = None, True
            thread.wake_at, thread.wake_class = self.time + timeout, TURN
            self._pass_turn()
        # Wait for the turn with `cond` released (it is the engine's lock), as cond.wait does.
        while True:
            with self._lock:
                if self._holder == me:
                    return
            cond.wait(0.001)

    def notify_all(self, cond: threading.Condition) -> None:
        with self._lock:
            for thread in self._threads.values():
                if thread.waiting:
                    thread.waiting, thread.wake_at, thread.runnable = False, None, TURN
        cond.notify_all()

    def run_step(self, step: LaneStep, work: Callable[[], T]) -> tuple[T, float]:
        assert self.lanes is not None, "attach the laned engine's core first"
        result = work()
        me = threading.get_ident()
        with self._lock:
            started = self.time
            self.lanes.start(step, started)
            self._stepping[step.lane] = me
            self._threads[me].runnable = None
            self._pass_turn()
            self._await_turn(me)
            return result, self.time - started

    def run_single(self, step: SingleStep, units: int, work: Callable[[], T]) -> tuple[T, float]:
        """A single-lane step, as the simulator times one: the prediction for its batch on
        every unit, times noise, then the host's time for the rows it samples (the only thread
        on the clock is the caller's)."""
        timing = time_single_step(self.perf, self.noise, step, units)
        result = work()
        with self._lock:
            self.time += timing.measured_s + timing.host_s
        return result, timing.measured_s

    # ---- turns (self._lock held) --------------------------------------------------------------

    def _yield(self, klass: int) -> None:
        me = threading.get_ident()
        with self._lock:
            self._threads[me].runnable = klass
            self._pass_turn()
            self._await_turn(me)

    def _await_turn(self, me: int) -> None:
        while self._holder != me:
            self._lock.wait()

    def _pass_turn(self) -> None:
        """Give the turn to the first runnable thread in order; with none, advance time to the
        next event and make its threads runnable."""
        while True:
            ready = [
                (t.runnable, self._rank(t), i)
                for i, t in self._threads.items()
                if t.runnable is not None
            ]
            if ready:
                self._holder = min(ready)[2]
                self._lock.notify_all()
                return
            if not self._threads:
                self._holder = None
                return
            self._advance()

    def _advance(self) -> None:
        lanes = self.lanes
        if lanes is not None:
            lanes.rerate(self.time)
        end = lanes.next_end() if lanes is not None else None
        wakes = [t.wake_at for t in self._threads.values() if t.wake_at is not None]
        times = wakes + ([end[0]] if end is not None else [])
        if not times:
            raise RuntimeError("the virtual clock stalled: every thread waits on nothing")
        self.time = max(self.time, min(times))
        for lane in ("prefill", "decode"):
            timing = lanes.timing[lane] if lanes is not None else None
            if timing is not None and timing.end <= self.time:
                lanes.end(lane, self.time)
                self._threads[self._stepping.pop(lane)].runnable = STEP_END
        for thread in self._threads.values():
            if thread.wake_at is not None and thread.wake_at <= self.time:
                thread.runnable, thread.wake_at, thread.waiting = thread.wake_class, None, False

    @staticmethod
    def _rank(thread: _Thread) -> int:
        return RANKS.get(thread.name, -1)
