"""Compiler processes for structured outputs (`grammar_worker.py`), each driven by a daemon
thread here: a job waits in a queue, runs in the first free process, and its requester gets the
serialized compiled grammar. A compile past its deadline (counted from when a process takes it
up), or whose every requester has left, is stopped by killing its process (which the thread
restarts at once), so that no compile holds a core, memory or the server's shutdown beyond its
bound.
"""

from __future__ import annotations

import logging
import math
import select
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bulletserve.engine.grammar_worker import read_message, write_message

logger = logging.getLogger(__name__)

# How often a running compile's thread looks for its deadline and for requesters that left.
POLL_S = 0.05
WORKER_START_TIMEOUT_S = 120.0


class CompileFailed(RuntimeError):
    """The compile did not finish: past its deadline, abandoned, or its process died."""


@dataclass(eq=False)
class CompileJob:
    """One spec being compiled, shared by every requester that asked for it meanwhile."""

    key: object
    message: dict[str, Any]
    timeout_s: float
    deadline: float = math.inf  # time.monotonic(), set when a compiler takes the job up
    result: Future = field(default_factory=Future)  # the serialized compiled grammar
    requesters: int = 1

    @property
    def abandoned(self) -> bool:
        return self.requesters <= 0


class _Worker:
    """One compiler process."""

    def __init__(self, tokenizer_json: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bulletserve.engine.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        write_message(self.stdin, tokenizer_json)
        if not self._readable(WORKER_START_TIMEOUT_S) or read_message(self.stdout) is None:
            self.kill()
            raise CompileFailed("the grammar compiler process did not start")

    def _readable(self, timeout_s: float) -> bool:
        return bool(select.select([self.stdout], [], [], max(timeout_s, 0.0))[0])

    def run(self, job: CompileJob) -> dict[str, str]:
        """The worker's reply to `job`; CompileFailed (and the process killed) where the job
        passes its deadline or is abandoned first, or the process dies."""
        write_message(self.stdin, job.message)
        while not self._readable(min(POLL_S, job.deadline - time.monotonic())):
            if job.abandoned:
                self.kill()
                raise CompileFailed("every request that asked for it has left")
            if time.monotonic() >= job.deadline:
                self.kill()
                raise CompileFailed(
                    f"it did not compile within {job.timeout_s:g} s (--grammar-compile-timeout)"
                )
        reply = read_message(self.stdout)
        if reply is None:
            self.kill()
            raise CompileFailed("the grammar compiler process died while compiling it")
        return reply

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.stdin, self.stdout):
            stream.close()


class CompilePool:
    """`workers` compiler processes over one queue of jobs, deduplicated by their key."""

    def __init__(self, tokenizer_json: str, workers: int) -> None:
        self._tokenizer_json = tokenizer_json
        self._jobs: deque[CompileJob] = deque()
        self._by_key: dict[object, CompileJob] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._workers: list[_Worker | None] = [None] * workers
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"grammar-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, key: object, message: dict[str, Any], timeout_s: float) -> CompileJob:
        """A job compiling `message` (one already queued or running for `key` where there is
        one: the caller becomes one more of its requesters)."""
        with self._cond:
            if self._closed:
                raise CompileFailed("the server is shutting down")
            job = self._by_key.get(key)
            if job is not None and not job.result.done() and not job.abandoned:
                job.requesters += 1
                return job
            job = CompileJob(key, message, timeout_s)
            self._by_key[key] = job
            self._jobs.append(job)
            self._cond.notify()
            return job

    def leave(self, job: CompileJob) -> None:
        """A requester no longer waits for `job`: with none left, it is dropped from the queue,
        or its process killed if it is running."""
        with self._cond:
            job.requesters -= 1
            if job.abandoned and job in self._jobs:
                self._jobs.remove(job)
                self._end(job, CompileFailed("every request that asked for it has left"))

    def _end(self, job: CompileJob, outcome: dict[str, str] | BaseException) -> None:
        """Settle `job` (state lock held)."""
        if self._by_key.get(job.key) is job:
            del self._by_key[job.key]
        if job.result.done():
            return
        if isinstance(outcome, BaseException):
            job.result.set_exception(outcome)
        else:
            job.result.set_result(outcome)

    def _next(self) -> CompileJob | None:
        """The next job, its deadline running from now: the time it waited in the queue (for
        a compiler to start, or behind other compiles) is not its own compile's."""
        with self._cond:
            while not self._closed:
                if self._jobs:
                    job = self._jobs.popleft()
                    job.deadline = time.monotonic() + job.timeout_s
                    return job
                self._cond.wait()
            return None

    def _serve(self, index: int) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            worker = self._workers[index]
            if worker is None or worker.process.poll() is not None:
                try:
                    worker = _Worker(self._tokenizer_json)
                except (CompileFailed, OSError) as exc:
                    logger.error("grammar compiler process %d: %s", index, exc)
                    worker = None
                with self._cond:
                    if self._closed and worker is not None:
                        worker.kill()
                        return
                    self._workers[index] = worker
            job = self._next()
            if job is None:
                return
            try:
                if worker is None:
                    raise CompileFailed("the grammar compiler process could not start")
                outcome: dict[str, str] | BaseException = worker.run(job)
            except (CompileFailed, OSError, ValueError) as exc:  # ValueError: closed by close()
                outcome = exc if isinstance(exc, CompileFailed) else CompileFailed(str(exc))
                self._workers[index] = None
            with self._cond:
                self._end(job, outcome)

    def close(self) -> None:
        """Fail what is queued and kill the processes (at once: nothing waits for a compile)."""
        with self._cond:
            self._closed = True
            while self._jobs:
                self._end(self._jobs.popleft(), CompileFailed("the server is shutting down"))
            workers = [w for w in self._workers if w is not None]
            self._cond.notify_all()
        for worker in workers:
            worker.kill()
