"""CPU partitioning: a lane's units are intra-op threads of the OS thread that runs it."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_one_thread() -> None:
    """Run the calling OS thread's torch ops on one intra-op thread from now on.

    `torch.set_num_threads` sets the calling thread's OpenMP thread count and a process-wide
    default, and a thread's first torch call after it (PyTorch initializes each thread's count
    lazily) re-applies the process-wide default, which another thread may have changed in
    between: the team thread sets 2 at every job. A decode lane reset that way sampled on 2
    threads and so led an OpenMP team of its own, and with three OpenMP threads on two cores
    GNU OpenMP cuts every worker's spin short: the team's worker then slept and woke at every
    parallel op (3,000 voluntary context switches a second on that worker in a bullet server at
    6 req/s, against about 90 a second in the whole single-lane server). Calling for the count
    right away makes the lazy initialization happen now, and setting 1 again after it holds
    whatever came between."""
    torch.set_num_threads(1)
    torch.get_num_threads()
    torch.set_num_threads(1)


@dataclass
class _Job:
    fn: Callable[[], object]
    threads: int | None
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class TeamThread:
    """One OS thread that runs every multi-threaded step of a two-lane engine on a CPU (and
    builds the engine, so the weights' loading leads no other team).

    GNU OpenMP keeps a pool of workers for each thread that has led a parallel region; once it
    manages more threads than there are cores it cuts their spin-wait short, and every parallel
    op then pays a futex wake-up. A SmolLM2 decode step on 2 threads took 1.16-1.30x as long
    beside an idle thread that had led a team of its own (`--decode` of
    `git show 23ed970:scripts/omp_two_teams.py`;
    bullet's decode lane against the single-lane engine: 1.14-1.29x): two lane threads each
    leading a team cost that much on every step."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.busy = threading.Lock()  # held by the lane whose step the thread runs
        self._thread = threading.Thread(target=self._serve, name="bullet-team", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T], threads: int | None = None) -> T:
        """Run `fn` on the team thread (on `threads` intra-op threads, if given) and return its
        result or raise its exception."""
        job = _Job(fn, threads)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.threads is not None:
                    torch.set_num_threads(job.threads)
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller, which raises it
                job.error = exc
            job.done.set()


class CpuThreads:
    """Units are intra-op threads; `torch.set_num_threads` applies to the calling OS thread.
    With a `team`, `run` gives multi-threaded steps to that one thread."""

    kind = "cpu"
    granularity = 1
    min_units = 1
    min_remainder = None  # any thread count may run beside another

    def __init__(self, total: int | None = None, team: TeamThread | None = None) -> None:
        self.total = total or usable_cores()
        self.device = torch.device("cpu")
        self.team = team

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

    def run(self, units: int, step: Callable[[], T], rest: bool = False) -> T:
        """`step()` on `units` threads (`rest`: on those the other lane left). A multi-threaded
        step goes to the team thread when there is one and it is free; a single-threaded one,
        or one beside a busy team thread (`--partition none` gives both lanes every thread),
        runs on the calling thread."""
        threads = self.total - units if rest else units
        if threads > 1 and self.team is not None and self.team.busy.acquire(blocking=False):
            try:
                return self.team.call(step, threads)
            finally:
                self.team.busy.release()
        with self.lane(units, rest):
            return step()

    def synchronize(self) -> None:
        """CPU work is synchronous."""
