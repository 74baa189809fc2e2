"""Bullet's executor: a prefill lane and a decode lane on their own threads, sharing the weights
and the KV pool, each running on the units the scheduler gives it at every step. The lanes'
state machine is `executor.lanes.LaneCore`, the simulator's too; this module adds the threads,
the device and the tokens, on the engine's clock (the wall clock, or a virtual one under test).

Each lane loops: under the state lock, take a snapshot and ask the policy for a plan, apply its
bookkeeping; release the lock and run the model on the lane's units; retake the lock to sample
and publish outputs. A step starts only on units the other lane's running step does not hold:
when the split moves units to a lane, that lane waits for the other's step to end. Blocks of a
request that a lane is computing are freed only after that lane's step ends, so an abort never
hands out memory a kernel is still writing.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import TypeVar

import torch

from bulletserve.bookkeeping.lane_core import LaneCore, LaneStep, Placement
from bulletserve.bookkeeping.record import Lane, write_step
from bulletserve.engine.config import HANDOFF_WAIT_S
from bulletserve.engine.model_runner import PrefillPass, SeqWork, request_work
from bulletserve.engine.parts import EngineParts
from bulletserve.engine.pricing import hardware_profile, perf_model
from bulletserve.engine.ranks import rank_threads
from bulletserve.engine.request import Request, RequestOutput, RequestState, TokenLogprob
from bulletserve.engine.sampler import Sampler
from bulletserve.engine.speculation import Speculator
from bulletserve.model.decoder import LogitsBuffer
from bulletserve.partition import TeamThread, Units, WholeGPU, lane_units
from bulletserve.partition.cpu import use_one_thread
from bulletserve.sched import make_policy
from bulletserve.sched.bullet import (
    BulletPlan,
    BulletPolicy,
    Split,
    UnitSpace,
)
from bulletserve.spec.counters import SpecCounters

logger = logging.getLogger(__name__)

# A sampled token and its logprob (when the request asked for them).
Sampled = tuple[int, TokenLogprob | None]

# Weight of each step in /metrics' running means of predicted and measured step times.
STEP_TIME_WEIGHT = 0.1

T = TypeVar("T")


class Lanes:
    """The engine's executor under `--policy bullet`: a prefill lane and a decode lane on their
    own threads (see the module's docstring)."""

    def __init__(self, parts: EngineParts, team: TeamThread | None = None) -> None:
        self.config = parts.config
        self.clock = parts.clock
        self.book = parts.book
        self.life = parts.life
        self.model_config = parts.model.config
        self._weight_bits = parts.model.weight_bits
        self.runner = parts.runner
        self.sampler = parts.sampler
        self.device = parts.device
        self.dtype = parts.dtype
        self.step_log = parts.step_log
        # On a CPU, the thread that built the engine (create_engine makes it) and runs every
        # multi-threaded lane step; the lane threads themselves never lead an OpenMP team.
        self._team = team
        self.policy = self._make_policy(parts)
        self._state = threading.Condition(threading.RLock())
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._unhanded = 0  # outputs emitted and not yet reported handed off
        self._taken = 0  # outputs the last `step()` calls returned, not yet reported
        config = self.config
        self.core: LaneCore[Request] = LaneCore(
            self.book,
            self.policy,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras,
        )
        self.clock.attach(self.core)
        self._pass: PrefillPass | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.prediction_error: dict[str, float] = {}  # lane -> last |predicted/measured - 1|
        # Step kind -> running means of (predicted, measured) seconds, for /metrics.
        self._step_times: dict[str, tuple[float, float]] = {}
        self.lane_error: BaseException | None = None
        # The decode lane samples inside its step, on the step's units and outside the state
        # lock, where the prefill lane may sample at the same time: a generator of its own
        # (torch.Generator is not safe to share between threads).
        self._decode_sampler = Sampler(config.seed + 1)
        # Each lane's logits, in memory of its own reused from step to step.
        self._logits = {"prefill": LogitsBuffer(), "decode": LogitsBuffer()}
        # Under speculative decoding the decode lane verifies drafts (the prefill lane's fused
        # rows carry none).
        speculation = config.speculative_config
        self.speculator = (
            None
            if speculation is None
            else Speculator(speculation, parts.life.max_model_len, parts.draft)
        )

    def _make_policy(self, parts: EngineParts) -> BulletPolicy:
        self.units: Units = lane_units(self.device, rank_threads(self.config), self._team)
        profile = hardware_profile(self.config.hardware_profile, self.units, self.dtype)
        self.perf = perf_model(parts, profile)
        config = self.config
        if isinstance(self.units, WholeGPU):  # one stream for both lanes: nothing to split
            config = dataclasses.replace(config, partition="none")
        units = UnitSpace(
            self.units.total, self.units.granularity, self.units.min_units, self.units.min_remainder
        )
        spec = config.speculative_config
        policy = make_policy(
            config,
            config.slo,
            self.perf,
            units,
            self.model_config.num_layers,
            price_drafts=spec is None or spec.adaptive,
        )
        assert isinstance(policy, BulletPolicy)
        return policy

    def thread_counts(self) -> list[int]:
        """Every thread count a lane's step may run on (`LaneCore.share`): the whole CPU, and under
        `auto` any carved group, under `static:P/D` P and what P leaves."""
        total = self.units.total
        if self.policy.partition == "none":
            return [total]
        if self.policy.static_split is not None:
            prefill = self.policy.static_split.prefill
            return sorted({total, prefill, total - prefill} - {0})
        return self.policy.units.counts()

    def wake(self) -> None:
        with self._state:
            self.clock.notify_all(self._state)

    def has_pending(self) -> bool:
        """A prefill batch in flight, or outputs the lanes produced that `step()` has not
        returned yet."""
        with self._state:
            return self.core.prefill is not None or not self._outputs.empty()

    def num_running(self) -> int:
        prefill = self.core.prefill
        return len(self.book.running) + (len(prefill.requests) if prefill else 0)

    @property
    def split(self) -> Split:
        """The split in force."""
        return self.core.split

    def lane_units(self) -> dict[str, tuple[int, float | None]]:
        split = self.split
        return {
            "prefill": (split.prefill, self.prediction_error.get("prefill")),
            "decode": (split.decode, self.prediction_error.get("decode")),
        }

    def spec_counters(self) -> SpecCounters | None:
        with self._state:
            return None if self.speculator is None else self.speculator.counters.copy()

    def step_times(self) -> dict[str, tuple[float, float]]:
        return dict(self._step_times)

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
        if outputs:
            with self._state:
                self._taken += len(outputs)
        return outputs

    def outputs_handed_off(self) -> None:
        with self._state:
            if not self._taken:
                # `step()` returned nothing (its caller polls while a step runs): no lane
                # waits on this, and waking both would take the GIL from the step's thread.
                return
            self._unhanded -= self._taken
            self._taken = 0
            self.clock.notify_all(self._state)

    def close(self) -> None:
        self._stop.set()
        with self._state:
            self.clock.notify_all(self._state)
        for thread in self._threads:
            thread.join(timeout=10)
        if self._team is not None:
            self._team.stop()

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
                target=self._guard(name, target), name=f"bullet-{name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _guard(self, name: Lane, lane: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                if self._team is not None:
                    # Single-threaded steps and sampling run here: one thread, no team.
                    use_one_thread()
                self.clock.enter(name)
                lane()
            except Exception as exc:
                logger.exception("lane failed")
                self.lane_error = exc
                self._stop.set()
            finally:
                self.clock.leave()

        return run

    # ---- shared bookkeeping (state lock held) -----------------------------------------------

    def _plan(self, lane: Lane) -> BulletPlan:
        """Take in new requests and aborts, then the lane's plan (its split comes into force)."""
        for output in self.life.take_in():
            self._emit(output)
        return self.core.plan(lane, self.clock.now(), self.perf.corrections)

    def _hand_over(self, rows: Iterable[tuple[Request, Sampled]]) -> None:
        """Hand the tokens a step sampled to the requests' life and emit their outputs."""
        now = self.clock.now()
        for request, (token, logprob) in rows:
            self.life.append_token(request, token, logprob, now)
            self._advanced(request)

    def _advanced(self, request: Request) -> None:
        """Emit the output of a request whose life took a step's tokens; one that ran to its
        end feeds the window of recent TPOTs."""
        t = request.timings
        if request.state is RequestState.FINISHED and t.first_token is not None:
            outputs = len(request.output_token_ids)
            self.core.window.finished(
                (t.finished - t.first_token) / (outputs - 1) if outputs > 1 else None,
                request.service.slo,
            )
        self._emit(self.life.output(request))

    def _emit(self, output: RequestOutput) -> None:
        self._unhanded += 1
        self._outputs.put(output)

    def _await_handoff(self) -> None:
        """Where `step()`'s caller reports hand-offs (the server), wait until the outputs
        emitted so far are written out, at most HANDOFF_WAIT_S, before planning a step: the
        event loop formatting tokens beside a multi-threaded step preempts one thread of the
        team, which every barrier then waits for. (The single-lane engine waits the same way
        in `AsyncEngine._deliver`; without it served decode steps ran 5-15% slower than
        offline ones.)"""
        if not self.life.acks_handoff:
            return
        deadline = time.monotonic() + HANDOFF_WAIT_S
        while self._unhanded > 0 and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._state.wait(left)

    def _wait(self, lane: Lane) -> None:
        """Sleep until notified (a request arrives or leaves, a step ends, units free up) or for
        the core's wait (`LaneCore.wait_s`)."""
        self.clock.wait(self._state, self.core.wait_s(lane, self.life.pending_intake))

    def _on_units(self, step: LaneStep[Request], work: Callable[[Placement], T]) -> tuple[T, float]:
        """Run `work(placement)` on the step's units (claimed in the core under the state lock
        when the step started), and release them when it ends; its result and the step's
        seconds. The placement goes to the runner, which tells the other ranks where to run."""
        placement = step.placement
        assert placement.units is not None
        step_work = partial(work, placement)
        run = partial(self.units.run, placement.units, step_work, rest=placement.rest)
        try:
            return self.clock.run_step(step, run)
        finally:
            with self._state:
                self.core.release_units(step.lane)
                self.clock.notify_all(self._state)

    def _log_step(
        self,
        step: LaneStep[Request],
        measured: float,
        runner_s: float,
        accepted: int | None = None,
        propose_s: float | None = None,
    ) -> None:
        """Feed the online correction and write the step log: what ran when the step started,
        under the split it started under (the other lane may have planned a new one since)."""
        es, lane = step.state, step.lane
        prediction = self.perf.predict(es)
        predicted = prediction.prefill_s if lane == "prefill" else prediction.decode_s
        if self.clock.measures:
            self.perf.observe(es, lane, measured)
            self.core.window.step(predicted, measured)
        if predicted > 0:
            self.prediction_error[lane] = abs(predicted / measured - 1)
            kind = "decode" if lane == "decode" else ("fused" if step.fused else "prefill")
            old = self._step_times.get(kind, (predicted, measured))
            self._step_times[kind] = (
                (1 - STEP_TIME_WEIGHT) * old[0] + STEP_TIME_WEIGHT * predicted,
                (1 - STEP_TIME_WEIGHT) * old[1] + STEP_TIME_WEIGHT * measured,
            )
        if self.step_log:
            record = step.record(
                self.clock.now(), measured, predicted, runner_s, accepted, propose_s
            )
            write_step(self.step_log, record)
            self.step_log.flush()

    # ---- the prefill lane -------------------------------------------------------------------

    def _prefill_lane(self) -> None:
        core = self.core
        while not self._stop.is_set():
            self.clock.checkpoint()
            with self._state:
                self._await_handoff()
                if not core.may_plan("prefill", pending=self.life.pending_intake):
                    self._wait("prefill")
                    continue
                plan = self._plan("prefill")
                if not core.runnable("prefill", plan):
                    self._wait("prefill")
                    continue
                step = core.start_prefill(plan)
                assert plan.prefill is not None
                if plan.prefill.admitted:
                    now = self.clock.now()
                    for request in step.requests:
                        request.state = RequestState.PREFILLING
                        if request.timings.first_scheduled is None:
                            request.timings.first_scheduled = now
                if step.layers[0] == 0:
                    self._pass = self.runner.begin_pass(self._pass_works(step))
                device_pass = self._pass
            (hidden, sampled, runner_s), measured = self._on_units(
                step, partial(self._prefill_step, device_pass, step)
            )
            with self._state:
                device_pass.hidden = hidden
                core.end_step("prefill")
                self._log_step(step, measured, runner_s)
                if step.layers[1] == self.model_config.num_layers:
                    self._end_pass(device_pass, sampled)
                self.clock.notify_all(self._state)

    def _pass_works(self, step: LaneStep[Request]) -> list[SeqWork]:
        """The device batch of a pass: each prompt's tokens in it (its rest, or the step's
        chunk of the one prompt) on top of those cached, then the fused decode rows."""
        works = [
            request_work(request, cached, cached + tokens)
            for request, cached, tokens in zip(
                step.requests, step.cached, step.lengths, strict=True
            )
        ]
        return works + [_decode_work(r) for r in step.fused]

    def _prefill_step(
        self, device_pass: PrefillPass, step: LaneStep[Request], placement: Placement
    ) -> tuple[torch.Tensor, list[Sampled], float]:
        """The layer group's hidden states; after the last group, a token (and logprob) per
        row that samples, in the batch's sampling order; and the seconds the model took (on
        the thread that ran it, without the hand-off to it). Sampling runs here, on the step's
        units, as in the decode lane (on the lane's own thread it ran on one CPU thread, under
        the state lock, and outside the measured step). Only this lane uses the engine's
        sampler, and the step's requests are busy, so nothing changes what it reads."""
        start = time.perf_counter()
        first, last = step.layers
        hidden, logits = self.runner.run_layers(
            device_pass, first, last, self._logits["prefill"], placement
        )
        self.units.synchronize()  # the step's device time, not its launch time
        runner_s = time.perf_counter() - start
        if logits is None:
            return hidden, [], runner_s
        members = step.requests + step.fused  # in the order of the pass's works
        requests = [members[work] for work in device_pass.batch.sampling_order]
        tokens, logprobs = self.sampler.sample(logits, requests, [r.stop_ids for r in requests])
        return hidden, list(zip(tokens, logprobs, strict=True)), runner_s

    def _decode_step(
        self, works: list[SeqWork], requests: list[Request], placement: Placement
    ) -> tuple[list[Sampled], float]:
        """A token (and logprob) per request, and the seconds the model took. Sampling runs here,
        on the step's units: on the decode lane's own thread it ran on one CPU thread, and at
        160 rows it added 30 ms to a 100 ms step, where the single-lane engine samples on
        every thread. The requests are busy, so no other thread changes what it reads."""
        logits, _, runner_s = self._decode_forward(works, requests, placement)
        tokens, logprobs = self._decode_sampler.sample(
            logits, requests, [r.stop_ids for r in requests]
        )
        return list(zip(tokens, logprobs, strict=True)), runner_s

    def _end_pass(self, device_pass: PrefillPass, sampled: list[Sampled]) -> None:
        """After a pass's last layer: the first tokens of the prompts it completed (and the
        fused decode rows' next ones) join their requests; those prompts join the decode
        lane."""
        prompts = self.core.prefill.requests  # the pass's first works; the fused rows follow
        for request, work in zip(prompts, device_pass.works[: len(prompts)], strict=True):
            if work.prompt_targets:
                request.keep_prompt_logprobs(work.start, work.prompt_logprobs)
        ended = self.core.end_pass(lambda request: request.is_finished)
        if self.core.prefill is None:
            self._pass = None
        if not ended.sampled:
            return
        # Tokens come in the step's sampling order (prompts of one token sit with the decode
        # rows); aborted requests' tokens are dropped.
        row_of = {work: row for row, work in enumerate(device_pass.batch.sampling_order)}
        now = self.clock.now()
        for request in ended.joined:
            if not request.output_token_ids:  # not a recomputation after preemption
                ttft = now - request.timings.arrival
                self.core.window.first_token(
                    ttft, len(request.prompt_token_ids), request.service.slo
                )
        tokens = (sampled[row_of[work]] for work in ended.rows)
        self._hand_over(zip(ended.sampled, tokens, strict=True))

    # ---- the decode lane --------------------------------------------------------------------

    def _decode_lane(self) -> None:
        core = self.core
        while not self._stop.is_set():
            self.clock.checkpoint()
            with self._state:
                self._await_handoff()
                if not core.may_plan("decode"):
                    self._wait("decode")
                    continue
                if self.speculator is not None:
                    self.speculator.propose(self.book.running)
                plan = self._plan("decode")
                for request in self.book.preempt(plan.preempted):
                    request.state = RequestState.WAITING
                if not core.runnable("decode", plan):
                    self._wait("decode")
                    continue
                step = core.start_decode(plan)
                rows = zip(step.requests, step.row_drafts, strict=True)
                works = [_decode_work(request, drafts) for request, drafts in rows]
            if self.speculator is not None:
                self._verify_step(step, works)
                continue
            (sampled, runner_s), measured = self._on_units(
                step, partial(self._decode_step, works, step.requests)
            )
            with self._state:
                core.end_step("decode")
                self._log_step(step, measured, runner_s)
                alive = []
                for request, token in zip(step.requests, sampled, strict=True):
                    if request.is_finished:  # aborted while its step ran: its token is dropped
                        self.book.release_blocks(request)
                    else:
                        alive.append((request, token))
                self._hand_over(alive)
                self.clock.notify_all(self._state)

    def _verify_step(self, step: LaneStep[Request], works: list[SeqWork]) -> None:
        """A decode step under speculative decoding: the forward on the lane's units, then,
        under the state lock, each row's tokens drawn position by position as far as its
        drafts hold (`Speculator.verify`: every draw reads its request's output so far, which
        the prefill lane's bookkeeping may touch) and the step counted."""
        assert self.speculator is not None
        propose_s = self.speculator.propose_s  # this step's: the lane proposes under the lock
        (logits, rows, runner_s), measured = self._on_units(
            step, partial(self._decode_forward, works, step.requests)
        )
        with self._state:
            aborted = {r.request_id for r in step.requests if r.is_finished}
            rejected = self.speculator.verify(
                rows, logits, self._decode_sampler, self.life, self.clock.now()
            )
            self.core.end_step("decode", lambda request: rejected.get(request.request_id, 0))
            accepted = sum(step.drafts) - sum(rejected.values())
            self._log_step(step, measured, runner_s, accepted, propose_s)
            for request in step.requests:
                if request.is_finished:
                    self.book.release_blocks(request)
                if request.request_id not in aborted:
                    self._advanced(request)
            self.clock.notify_all(self._state)

    def _decode_forward(
        self, works: list[SeqWork], requests: list[Request], placement: Placement
    ) -> tuple[torch.Tensor, list[Request], float]:
        """A decode step's logits, each row's request (a verified row's 1 + d in a run) and
        the seconds the model took (on the device: synchronized)."""
        start = time.perf_counter()
        logits, order = self.runner.execute(works, self._logits["decode"], "decode", placement)
        self.units.synchronize()
        return logits, [requests[work] for work in order], time.perf_counter() - start


def _decode_work(request: Request, drafts: int = 0) -> SeqWork:
    """A decoding request's share of a step: its last token and `drafts` of its drafts, on top
    of its cached context."""
    return request_work(request, request.num_tokens - 1, request.num_tokens + drafts)
