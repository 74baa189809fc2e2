"""Bullet's executor: a prefill lane and a decode lane on their own threads, sharing the weights
and the KV pool, each running on the units the scheduler gives it at every step.

Each lane loops: under the state lock, take a snapshot and ask the policy for a plan, apply its
bookkeeping; release the lock and run the model on the lane's units; retake the lock to sample
and publish outputs. A step starts only on units the other lane's running step does not hold:
when the split moves units to a lane, that lane waits for the other's step to end. Blocks of a
request that a lane is computing are freed only after that lane's step ends, so an abort never
hands out memory a kernel is still writing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from bulletserve.engine.config import EngineConfig
from bulletserve.engine.engine import HANDOFF_WAIT_S, LLMEngine
from bulletserve.engine.request import Request, RequestOutput, RequestState, TokenLogprob
from bulletserve.engine.runner import SeqWork, StepBatch
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.sampling_params import SamplingParams
from bulletserve.executor.record import Lane, StepRecord, write_step
from bulletserve.partition import TeamThread, Units, WholeGPU, lane_units
from bulletserve.partition.cpu import use_one_thread
from bulletserve.perf.hardware import HardwareProfile
from bulletserve.perf.model import PerfModel
from bulletserve.perf.profiler import DTYPE_NAMES, PLANS, measure_device
from bulletserve.perf.state import ExecutionState, fused_step_state
from bulletserve.sched.bullet import (
    BulletPolicy,
    BulletSnapshot,
    PrefillInFlight,
    PrefillStep,
    Slo,
    Split,
    UnitSpace,
    parse_partition,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.005


@dataclass
class PrefillBatch:
    """The prefill lane's batch: prompts (plus tokens to recompute after preemption) that it
    computes in passes over the layers, a pass taking every prompt's rest or a chunk of the
    batch's one prompt; the prompts join the decode lane after the pass that completes them.
    Per pass: the device batch, each prompt's tokens in it and in the cache before it, and the
    decoding requests whose next token rides in its step (the fused rules)."""

    requests: list[Request]
    batch: StepBatch | None = None
    hidden: torch.Tensor | None = None
    layers_done: int = 0
    stepping: bool = False  # a step of it is running (or its bookkeeping not yet done)
    pass_tokens: tuple[int, ...] = ()
    pass_cached: tuple[int, ...] = ()
    fused: list[Request] = field(default_factory=list)


class LanedEngine(LLMEngine):
    def __init__(self, config: EngineConfig, team: TeamThread | None = None) -> None:
        # On a CPU, the thread that builds the engine (create_engine makes it) and runs every
        # multi-threaded lane step; the lane threads themselves never lead an OpenMP team.
        self._team = team
        super().__init__(config)
        self._state = threading.Condition(threading.RLock())
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._unhanded = 0  # outputs emitted and not yet reported handed off
        self._taken = 0  # outputs the last `step()` calls returned, not yet reported
        self._prefill: PrefillBatch | None = None
        self._computing = {"prefill": 0, "decode": 0}  # units each lane's running step holds
        self.split = Split(0, self.units.total, "no-prefill")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._latency = self.policy.latency_window()
        self.prediction_error: dict[str, float] = {}  # lane -> last |predicted/measured - 1|
        self.lane_error: BaseException | None = None
        # The decode lane samples inside its step, on the step's units and outside the state
        # lock, where the prefill lane may sample at the same time: a generator of its own
        # (torch.Generator is not safe to share between threads).
        self._decode_sampler = Sampler(config.seed + 1)

    def _make_policy(self) -> BulletPolicy:
        self.units: Units = lane_units(self.device, self.config.num_threads, self._team)
        dtype = DTYPE_NAMES[self.dtype]
        profile = self._hardware_profile()
        mode, static = parse_partition(self.config.partition, self.units.total)
        if isinstance(self.units, WholeGPU):
            mode, static = "none", None
        self.perf = PerfModel(self.model_config, profile, dtype)
        return BulletPolicy(
            perf=self.perf,
            units=UnitSpace(
                self.units.total,
                self.units.granularity,
                self.units.min_units,
                self.units.min_remainder,
            ),
            num_layers=self.model_config.num_layers,
            slo=Slo(
                self.config.slo_ttft_per_token_ms / 1e3,
                self.config.slo_tpot_ms / 1e3,
                self.config.slo_ttft_base_ms / 1e3,
            ),
            layers_per_step=self.config.prefill_layers_per_step,
            partition=mode,
            static_split=static,
            fuse_decode=self.config.fuse_decode,
        )

    def _thread_counts(self) -> list[int]:
        """Every thread count a lane's step may run on (`_share`): the whole CPU, and under
        `auto` any carved group, under `static:P/D` P and what P leaves."""
        total = self.units.total
        if self.policy.partition == "none":
            return [total]
        if self.policy.static_split is not None:
            prefill = self.policy.static_split.prefill
            return sorted({total, prefill, total - prefill} - {0})
        return self.policy.units.counts()

    def _hardware_profile(self) -> HardwareProfile:
        if self.config.hardware_profile:
            return HardwareProfile.load(self.config.hardware_profile)
        logger.warning(
            "no --hardware-profile: measuring peak GEMM rate and bandwidth now (a few seconds); "
            "`bullet profile` gives the scheduler calibrated predictions"
        )
        return measure_device(
            self.units, PLANS["quick"], "measured-at-start", logger.info, self.dtype
        )

    # ---- the engine interface ---------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        request_id = super().add_request(prompt, params, request_id, arrival_time)
        with self._state:
            self._state.notify_all()
        return request_id

    def abort_request(self, request_id: str) -> None:
        super().abort_request(request_id)
        with self._state:
            self._state.notify_all()

    def has_unfinished(self) -> bool:
        """Work left, or outputs the lanes produced that `step()` has not returned yet."""
        with self._state:
            pending = self._prefill is not None or not self._outputs.empty()
            return pending or super().has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.running) + (len(self._prefill.requests) if self._prefill else 0)

    def lane_units(self) -> dict[str, tuple[int, float | None]]:
        split = self.split
        return {
            "prefill": (split.prefill, self.prediction_error.get("prefill")),
            "decode": (split.decode, self.prediction_error.get("decode")),
        }

    def step(self) -> list[RequestOutput]:
        """Start the lanes on first use; return the outputs they produced since the last call
        (waiting briefly for at least one)."""
        if self.lane_error is not None:
            raise RuntimeError(f"a lane failed: {self.lane_error!r}") from self.lane_error
        if not self._threads:
            self._start()
        outputs = []
        try:
            outputs.append(self._outputs.get(timeout=0.05))
            while True:
                outputs.append(self._outputs.get_nowait())
        except queue.Empty:
            pass
        with self._state:
            self._taken += len(outputs)
        return outputs

    def outputs_handed_off(self) -> None:
        with self._state:
            self._unhanded -= self._taken
            self._taken = 0
            self._state.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._state:
            self._state.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._team is not None:
            self._team.stop()
        super().close()

    def _start(self) -> None:
        space = self.policy.units
        self.units.prepare(
            [
                c
                for c in range(1, space.total)
                if space.is_valid(c) and space.is_valid(space.total - c)
            ]
        )
        for name, target in (("prefill", self._prefill_lane), ("decode", self._decode_lane)):
            thread = threading.Thread(
                target=self._guard(target), name=f"bullet-{name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _guard(self, lane: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                if self._team is not None:
                    # Single-threaded steps and sampling run here: one thread, no team.
                    use_one_thread()
                lane()
            except Exception as exc:
                logger.exception("lane failed")
                self.lane_error = exc
                self._stop.set()

        return run

    # ---- shared bookkeeping (state lock held) -----------------------------------------------

    def _snapshot(self) -> BulletSnapshot:
        for output in self._drain_inbox():
            self._emit(output)
        prefill = None
        if self._prefill is not None:
            views = tuple(r.view() for r in self._prefill.requests)
            prefill = PrefillInFlight(views, self._prefill.layers_done, self._prefill.stepping)
        return BulletSnapshot(
            now=time.monotonic(),
            waiting=self.book.waiting_views(),
            prefill=prefill,
            # Every decoding request, those in the decode lane's running step too: the prefill
            # lane must see that decode has work, or its split would claim the decode lane's
            # units and wait for them while decode keeps stepping.
            decoding=self.book.running_views(),
            free_blocks=self.pool.allocator.num_free,
            block_size=self.pool.block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_prefill_tokens=self.config.max_num_batched_tokens,
            stats=self._latency.stats(),
            split=self.split,
            corrections=self.perf.corrections,
        )

    def _finish(
        self, request: Request, reason: str, state: RequestState = RequestState.FINISHED
    ) -> None:
        super()._finish(request, reason, state)
        t = request.timings
        if state is RequestState.FINISHED and t.first_token is not None:
            outputs = len(request.output_token_ids)
            self._latency.finished(
                (t.finished - t.first_token) / (outputs - 1) if outputs > 1 else None
            )

    def _publish(self, requests: list[Request]) -> None:
        for request in requests:
            self._emit(self._output(request))

    def _emit(self, output: RequestOutput) -> None:
        self._unhanded += 1
        self._outputs.put(output)

    def _await_handoff(self) -> None:
        """Where `step()`'s caller reports hand-offs (the server), wait until the outputs
        emitted so far are written out, at most HANDOFF_WAIT_S, before planning a step: the
        event loop formatting tokens beside a multi-threaded step preempts one thread of the
        team, which every barrier then waits for. (The single-lane engine waits the same way
        in `AsyncEngine._deliver`; lanes that did not ran their decode steps 5-15% slower
        served than the single-lane engine's at the same batch, bench-cpu-55, and as fast
        offline.)"""
        if not self.acks_handoff:
            return
        deadline = time.monotonic() + HANDOFF_WAIT_S
        while self._unhanded > 0 and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._state.wait(left)

    def _has_work(self, lane: str) -> bool:
        """Whether the lane has anything to plan: requests or aborts to take in, a prompt to
        prefill (prefill lane), sequences to decode (decode lane)."""
        if lane == "prefill":
            return bool(self._inbox or self._aborts or self.waiting) or self._prefill is not None
        return bool(self.running)

    def _wait(self, lane: str) -> None:
        """Sleep until notified (a request arrives or leaves, a step ends, units free up). Poll
        quickly only while the lane holds back work of its own and the other lane leaves it
        units to start on (its plan may change with time: a prompt comes at risk). While the
        other lane's step holds every unit nothing can start before that step ends, which
        notifies; a lane that planned every few ms meanwhile would take the GIL and a core from
        the compute threads (0.5 ms of Python every 5 ms on another thread slowed a 2-thread
        decode step 7-9%: `git show 23ed970:scripts/poll_cost.py`)."""
        other = "decode" if lane == "prefill" else "prefill"
        blocked = self.policy.partition != "none" and self._computing[other] >= self.units.total
        poll = self._has_work(lane) and not blocked
        self._state.wait(timeout=IDLE_WAIT_S if poll else 0.5)

    def _share(self, lane: str, split: Split) -> int:
        """The units a lane's step runs on under `split`: prefill on its units, decode on the
        rest; with no prefill units (or no partitioning) a lane has the whole device."""
        if self.policy.partition == "none" or split.prefill == 0:
            return self.units.total
        return split.prefill if lane == "prefill" else self.units.total - split.prefill

    def _may_start(self, lane: str, split: Split) -> bool:
        """Whether the lane's step fits beside the other lane's running step. A step keeps its
        units until it ends: a lane that the new split gives more waits for them rather than
        oversubscribing the device (on a CPU two thread teams on one core stall each other at
        every barrier). Without partitioning, both lanes share every unit by design."""
        if self.policy.partition == "none":
            return True
        other = "decode" if lane == "prefill" else "prefill"
        return self._share(lane, split) + self._computing[other] <= self.units.total

    def _on_units(self, lane: str, split: Split, step: Callable[[], T]) -> T:
        """Run `step()` on the lane's share (claimed in `_computing` under the state lock when
        the step was planned), and release the share when it ends."""
        share = self._share(lane, split)
        try:
            if lane == "decode" and share < self.units.total:
                # The units the prefill group leaves (on a GPU, the disjoint remainder).
                return self.units.run(split.prefill, step, rest=True)
            return self.units.run(share, step)
        finally:
            with self._state:
                self._computing[lane] = 0
                self._state.notify_all()

    def _execution_state(
        self,
        split: Split,
        prefill_lens: tuple[int, ...],
        prefill_cached: tuple[int, ...],
        decode_ctx: tuple[int, ...],
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> ExecutionState:
        """What ran while this lane stepped, as the performance model describes it."""
        total = self.units.total
        shared = self.policy.partition == "none"
        prefill_on = bool(prefill_lens) and (split.prefill > 0 or shared)
        decode_on = bool(decode_ctx) and (split.decode > 0 or shared)
        end = self.model_config.num_layers if layer_end is None else layer_end
        return ExecutionState(
            prefill_lens=prefill_lens if prefill_on else (),
            prefill_cached=prefill_cached if prefill_on and any(prefill_cached) else (),
            prefill_units=(split.prefill or total) if prefill_on else 0,
            decode_ctx=decode_ctx if decode_on else (),
            decode_units=(split.decode or total) if decode_on else 0,
            prefill_layers=end - layer_start,
            prefill_first_layer=layer_start,
        )

    def _log_step(
        self,
        lane: Lane,
        split: Split,
        es: ExecutionState,
        measured: float,
        *,
        batch_size: int,
        prefill_tokens: int,
        decode_rows: int,
        runner_s: float,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Feed the online correction and write the step log; `split` is the one the step ran
        under (the other lane may have planned a new one since)."""
        prediction = self.perf.predict(es)
        predicted = prediction.prefill_s if lane == "prefill" else prediction.decode_s
        self.perf.observe(es, lane, measured)
        if predicted > 0:
            self.prediction_error[lane] = abs(predicted / measured - 1)
        if self._step_log:
            record = StepRecord(
                time=time.monotonic(),
                lane=lane,
                split=(split.prefill, split.decode),
                rule=split.rule,
                units=self._share(lane, split),
                batch_size=batch_size,
                prefill_tokens=prefill_tokens,
                decode_rows=decode_rows,
                layers=layers,
                state=es,
                predicted_s=predicted,
                measured_s=measured,
                runner_s=runner_s,
            )
            write_step(self._step_log, record)
            self._step_log.flush()

    # ---- the prefill lane -------------------------------------------------------------------

    def _prefill_lane(self) -> None:
        while not self._stop.is_set():
            with self._state:
                self._await_handoff()
                if not self._has_work("prefill"):
                    self._wait("prefill")
                    continue
                plan = self.policy.plan_prefill(self._snapshot())
                self.split = plan.split
                if (
                    plan.prefill is None
                    or plan.split.prefill == 0
                    or not self._may_start("prefill", plan.split)
                ):
                    self._wait("prefill")
                    continue
                self._computing["prefill"] = self._share("prefill", plan.split)
                if plan.prefill.admitted:
                    self._admit(plan.prefill.admitted)
                batch = self._prefill
                batch.stepping = True
                if plan.prefill.layer_start == 0:
                    self._begin_pass(batch, plan.prefill)
            start = time.perf_counter()
            hidden, logits, runner_s = self._on_units(
                "prefill", plan.split, partial(self._prefill_step, batch, plan.prefill)
            )
            measured = time.perf_counter() - start
            with self._state:
                batch.hidden, batch.layers_done = hidden, plan.prefill.layer_end
                batch.stepping = False
                if batch.fused:
                    es, _ = fused_step_state(
                        list(zip(batch.pass_tokens, batch.pass_cached, strict=True)),
                        [r.num_tokens for r in batch.fused],
                        self.units.total,
                    )
                else:
                    es = self._execution_state(
                        plan.split,
                        batch.pass_tokens,
                        batch.pass_cached,
                        tuple(r.num_tokens for r in self.running),
                        plan.prefill.layer_start,
                        plan.prefill.layer_end,
                    )
                self._log_step(
                    "prefill",
                    plan.split,
                    es,
                    measured,
                    batch_size=len(batch.requests),
                    prefill_tokens=sum(batch.pass_tokens),
                    decode_rows=len(batch.fused),
                    layers=(plan.prefill.layer_start, plan.prefill.layer_end),
                    runner_s=runner_s,
                )
                if plan.prefill.layer_end == self.model_config.num_layers:
                    self._end_pass(batch, logits)
                self._state.notify_all()

    @torch.inference_mode()
    def _prefill_step(
        self, batch: PrefillBatch, step: PrefillStep
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """The layer group's hidden states, the logits when it was the last group and a row
        samples, and the seconds the model took (on the thread that ran it, without the
        hand-off to it)."""
        start = time.perf_counter()
        hidden = batch.hidden
        if hidden is None:
            hidden = self.model.embed(batch.batch.input_ids)
        hidden = self.model.run_layers(
            hidden,
            batch.batch.positions,
            self.pool.layers,
            batch.batch.meta,
            step.layer_start,
            step.layer_end,
        )
        logits = None
        if step.layer_end == self.model_config.num_layers and batch.batch.sampling_order:
            logits = self.runner.logits(hidden, batch.batch)
        self.units.synchronize()  # the step's device time, not its launch time
        return hidden, logits, time.perf_counter() - start

    def _decode_step(
        self, works: list[SeqWork], requests: list[Request]
    ) -> tuple[list[tuple[int, TokenLogprob | None]], float]:
        """A token (and logprob) per request, and the seconds the model took. Sampling runs here,
        on the step's units: on the decode lane's own thread it ran on one CPU thread, and at
        160 rows it added 30 ms to a 100 ms step, where the single-lane engine samples on
        every thread. The requests are busy, so no other thread changes what it reads."""
        start = time.perf_counter()
        logits, _ = self.runner.execute(works)
        self.units.synchronize()
        runner_s = time.perf_counter() - start
        tokens, logprobs = self._decode_sampler.sample(
            logits, requests, [r.stop_ids for r in requests]
        )
        return list(zip(tokens, logprobs, strict=True)), runner_s

    def _admit(self, admitted: tuple[str, ...]) -> None:
        """Move the admitted prompts from the queue into a new batch, with KV for all of them.
        The whole batch counts as busy until its prefill ends: an abort between layer groups
        or chunks must not free blocks a later step writes."""
        requests = self.book.take_waiting(admitted)
        for request in requests:
            self.book.grow_blocks(request, request.num_tokens)
            request.state = RequestState.PREFILLING
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = time.monotonic()
        self._prefill = PrefillBatch(requests)
        self.book.busy.update(r.request_id for r in requests)

    def _begin_pass(self, batch: PrefillBatch, step: PrefillStep) -> None:
        """Prepare the device batch of a pass: each prompt's rest (or the step's chunk of the
        one prompt), and the decoding requests fused into the step."""
        works = []
        for request in batch.requests:
            start = request.num_computed_tokens
            end = request.num_tokens if step.chunk is None else start + step.chunk
            works.append(
                SeqWork(
                    request.token_ids(start, end),
                    start,
                    request.block_table,
                    end == request.num_tokens,
                )
            )
        batch.pass_tokens = tuple(len(w.token_ids) for w in works)
        batch.pass_cached = tuple(w.start for w in works)
        by_id = {r.request_id: r for r in self.running}
        batch.fused = [by_id[s.request_id] for s in step.decode]
        for request in batch.fused:
            self.book.grow_blocks(request, request.num_tokens)
        works += [_decode_work(r) for r in batch.fused]
        self.book.busy.update(r.request_id for r in batch.fused)
        batch.batch, batch.hidden = self.runner.prepare(works), None

    def _end_pass(self, batch: PrefillBatch, logits: torch.Tensor | None) -> None:
        """After a pass's last layer: sample the first tokens of the prompts it completed (and
        the fused decode rows' next ones); those prompts join the decode lane. A prompt with
        chunks to go stays in the lane, unless it was aborted."""
        step_batch, fused = batch.batch, batch.fused
        for request, cached, tokens in zip(
            batch.requests, batch.pass_cached, batch.pass_tokens, strict=True
        ):
            request.num_computed_tokens = cached + tokens
        for request in fused:
            request.num_computed_tokens = request.num_tokens
        complete = all(r.num_computed_tokens == r.num_tokens for r in batch.requests)
        ends = complete or all(r.is_finished for r in batch.requests)
        members = batch.requests + fused  # in the order of the step's works
        leaving = members if ends else fused
        self.book.busy.difference_update(r.request_id for r in leaving)
        if ends:
            self._prefill = None
        else:
            batch.layers_done, batch.batch, batch.hidden, batch.fused = 0, None, None, []
        live: list[tuple[int, Request]] = []
        for work, request in enumerate(members):
            if work < len(batch.requests) and not ends:
                continue
            if request.is_finished:  # aborted while its step ran: its token is dropped
                self.book.release_blocks(request)
            else:
                live.append((work, request))
        if not live:
            return
        # Logits come in the step's row order (prompts of one token sit with the decode rows).
        row_of = {work: row for row, work in enumerate(step_batch.sampling_order)}
        requests = [request for _, request in live]
        tokens, logprobs = self.sampler.sample(
            logits[[row_of[work] for work, _ in live]], requests, [r.stop_ids for r in requests]
        )
        now = time.monotonic()
        for (work, request), token, logprob in zip(live, tokens, logprobs, strict=True):
            if work < len(batch.requests):  # a prompt: it joins the decode lane
                self.running.append(request)
                if not request.output_token_ids:  # not a recomputation after preemption
                    ttft = now - request.timings.arrival
                    self._latency.first_token(ttft, len(request.prompt_token_ids))
            self._append_token(request, token, logprob, now)
        self._publish(requests)

    # ---- the decode lane --------------------------------------------------------------------

    def _decode_lane(self) -> None:
        while not self._stop.is_set():
            with self._state:
                self._await_handoff()
                # While a prefill step carries the decode rows, nothing here may change them
                # (a preemption would take a request out from under that step).
                fusing = self._prefill is not None and bool(self._prefill.fused)
                if fusing or not self._has_work("decode"):
                    self._wait("decode")
                    continue
                plan = self.policy.plan_decode(self._snapshot())
                self.split = plan.split
                for request in self.book.preempt(plan.preempted):
                    request.state = RequestState.WAITING
                if (
                    not plan.decode
                    or plan.split.decode == 0
                    or not self._may_start("decode", plan.split)
                ):
                    self._wait("decode")
                    continue
                self._computing["decode"] = self._share("decode", plan.split)
                by_id = {r.request_id: r for r in self.running}
                requests = [by_id[s.request_id] for s in plan.decode]
                for request in requests:
                    self.book.grow_blocks(request, request.num_tokens)
                works = [_decode_work(r) for r in requests]
                self.book.busy.update(r.request_id for r in requests)
                prefill_lens, prefill_cached = (), ()
                if self._prefill is not None:
                    prefill_lens = self._prefill.pass_tokens
                    prefill_cached = self._prefill.pass_cached
            start = time.perf_counter()
            sampled, runner_s = self._on_units(
                "decode", plan.split, partial(self._decode_step, works, requests)
            )
            measured = time.perf_counter() - start
            with self._state:
                self.book.busy.difference_update(r.request_id for r in requests)
                es = self._execution_state(
                    plan.split, prefill_lens, prefill_cached, tuple(r.num_tokens for r in requests)
                )
                self._log_step(
                    "decode",
                    plan.split,
                    es,
                    measured,
                    batch_size=len(requests),
                    prefill_tokens=0,
                    decode_rows=len(requests),
                    runner_s=runner_s,
                )
                alive = []
                now = time.monotonic()
                for request, (token, logprob) in zip(requests, sampled, strict=True):
                    request.num_computed_tokens = request.num_tokens
                    if request.is_finished:  # aborted while its step ran: its token is dropped
                        self.book.release_blocks(request)
                    else:
                        self._append_token(request, token, logprob, now)
                        alive.append(request)
                if alive:
                    self._publish(alive)
                self._state.notify_all()


def _decode_work(request: Request) -> SeqWork:
    """A decoding request's share of a step: its last token, on top of its cached context."""
    last = request.num_tokens - 1
    return SeqWork(request.token_ids(last, request.num_tokens), last, request.block_table, True)
