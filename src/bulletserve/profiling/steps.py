"""Real prefill and decode steps through the engine's model runner, alone and co-running."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch

from bulletserve.engine.model_runner import ModelRunner, SeqWork
from bulletserve.kv.pool import KVPool
from bulletserve.model.decoder import DecoderLM
from bulletserve.partition import CpuThreads, GreenContextSMs
from bulletserve.partition.measure import time_call
from bulletserve.perf.execution_state import ExecutionState
from bulletserve.perf.fit import StepSample

Units = CpuThreads | GreenContextSMs


class StepBench:
    """Times steps of `model`; each lane gets its own runner over one shared KV pool."""

    def __init__(self, model: DecoderLM, units: Units, max_tokens: int, block_size: int = 16):
        self.model, self.units, self.block_size = model, units, block_size
        dtype = next(model.parameters()).dtype
        blocks = -(-max_tokens // block_size) + 64
        self.pool = KVPool(model.config, blocks, block_size, dtype, units.device)
        # The pool hands blocks out first-in first-out, so each state's sequences get blocks
        # no step has touched; on a CPU their pages would fault in during the timed step (a
        # 32-row decode at context 512 reads 750 MB of KV: 234-327 ms on fresh pages, 204-223
        # with this pool written first, two AMD Zen 3 threads), where a served decode reads KV
        # that its prefill already wrote.
        self.pool.kv.zero_()
        self._runners = [ModelRunner(model, self.pool, units.device) for _ in range(2)]
        self._vocab = model.config.vocab_size

    def _works(self, lens: list[int], starts: list[int]) -> list[SeqWork]:
        works = []
        gen = torch.Generator().manual_seed(len(lens))
        for n, start in zip(lens, starts, strict=True):
            blocks = self.pool.allocator.allocate(-(-(start + n) // self.block_size))
            ids = torch.randint(1, self._vocab, (n,), generator=gen).tolist()
            works.append(SeqWork(ids, start, blocks, samples=True))
        return works

    def _free(self, works: list[SeqWork]) -> None:
        for w in works:
            self.pool.allocator.free(w.block_table)

    def prefill_works(self, lens: list[int], cached: list[int] | None = None) -> list[SeqWork]:
        """Prefill `lens` new tokens per sequence on `cached` tokens already in the cache."""
        return self._works(lens, cached or [0] * len(lens))

    def decode_works(self, batch: int, context: int) -> list[SeqWork]:
        """`batch` one-token steps at `context` (the new token included)."""
        return self._works([1] * batch, [context - 1] * batch)

    def _step(self, lane: int, works: list[SeqWork]) -> Callable[[], object]:
        runner = self._runners[lane]
        return lambda: runner.execute(works)

    def alone(self, works: list[SeqWork], count: int, repeats: int) -> float:
        """Fastest of `repeats` steps of `works` on `count` units, nothing else running."""
        try:
            with self.units.lane(count):
                return time_call(self._step(0, works), self.units.synchronize, repeats)
        finally:
            self._free(works)

    def corun(
        self,
        prefill: list[SeqWork],
        prefill_units: int,
        decode: list[SeqWork],
        repeats: int,
    ) -> tuple[float, float]:
        """(prefill, decode) median step seconds with both lanes running at once, prefill on
        `prefill_units` units and decode on the rest. Each lane keeps stepping until both have
        `repeats` steps that ended while the other lane was still running."""
        times: list[list[float]] = [[], []]
        ready = threading.Barrier(2)
        stop = threading.Event()
        lock = threading.Lock()
        errors: list[BaseException] = []
        sync = self.units.synchronize

        def lane(index: int, works: list[SeqWork]) -> None:
            try:
                with self.units.lane(prefill_units, rest=index == 1):
                    step = self._step(index, works)
                    step()
                    sync()
                    ready.wait()
                    while not stop.is_set():
                        start = time.perf_counter()
                        step()
                        sync()
                        with lock:
                            if stop.is_set():
                                break
                            times[index].append(time.perf_counter() - start)
                            if min(len(times[0]), len(times[1])) >= repeats:
                                stop.set()
            except threading.BrokenBarrierError:
                pass
            except BaseException as exc:  # re-raised on the calling thread
                errors.append(exc)
                stop.set()
                ready.abort()

        threads = [
            threading.Thread(target=lane, args=(0, prefill)),
            threading.Thread(target=lane, args=(1, decode)),
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            self._free(prefill)
            self._free(decode)
        if errors:
            raise errors[0]
        return statistics.median(times[0]), statistics.median(times[1])

    def _once(self, works: list[SeqWork], count: int) -> float:
        """Seconds of one step of `works` on `count` units; frees the works."""
        try:
            with self.units.lane(count):
                start = time.perf_counter()
                self._step(0, works)()
                self.units.synchronize()
                return time.perf_counter() - start
        finally:
            self._free(works)

    def state_works(self, es: ExecutionState) -> tuple[list[SeqWork], list[SeqWork]]:
        """(prefill works, decode works) for the sequences of `es`."""
        prefill = (
            self.prefill_works(list(es.prefill_lens), list(es.prefill_cached) or None)
            if es.has_prefill
            else []
        )
        decode = self._works([1] * es.decode_batch, [c - 1 for c in es.decode_ctx])
        return prefill, decode

    def measure(self, states: list[ExecutionState], repeats: int) -> list[StepSample]:
        """Time every state: one lane alone on its units, or both co-running.

        `repeats` rounds go round all the states (after a warm-up round for the alone ones;
        `corun` warms itself up) and each keeps its median round: a slow spell of a shared
        machine, which lasts seconds, then costs one round of several states, not every round
        of one state or every state of one kind. The median, not the fastest round: served
        steps run at the machine's typical speed, and the fastest of three flattered a step by
        4-19% (`git show 23ed970:scripts/profile_rounds.py`), which the simulator then carried
        into every figure. A co-running round is a `corun` of two steps. Returns one sample per
        alone state and two (prefill, decode) per co-running one."""
        rounds: list[list[list[float]]] = [[[], []] for _ in states]
        for round_ in range(repeats + 1):
            for i, es in enumerate(states):
                both = es.has_prefill and es.has_decode
                if both and round_ == 0:
                    continue
                prefill, decode = self.state_works(es)
                if both:
                    times = self.corun(prefill, es.prefill_units, decode, 2)
                elif es.has_prefill:
                    times = (self._once(prefill, es.prefill_units),)
                else:
                    times = (self._once(decode, es.decode_units),)
                if round_:
                    for lane, t in enumerate(times):
                        rounds[i][lane].append(t)
        samples = []
        for es, lanes in zip(states, rounds, strict=True):
            medians = [statistics.median(t) for t in lanes if t]
            if es.has_prefill and es.has_decode:
                samples += [
                    StepSample(es, "prefill", True, medians[0]),
                    StepSample(es, "decode", True, medians[1]),
                ]
            else:
                phase = "prefill" if es.has_prefill else "decode"
                samples.append(StepSample(es, phase, False, medians[0]))
        return samples

    def prepare_overhead(self, repeats: int) -> float:
        """Host-side seconds to build a one-sequence decode batch: the fixed cost of a step."""
        works = self.decode_works(1, 2)
        try:
            return time_call(lambda: self._runners[0].prepare(works), lambda: None, repeats)
        finally:
            self._free(works)
