"""Two lanes: `LanedEngine` (engine/lanes.py) on the virtual clock, for the Bullet policy.

Each lane loops as in the engine: snapshot, plan (the split it returns comes into force), the
plan's bookkeeping, then its step on its own units; at the step's end the lane updates the state
and wakes the other lane. A lane with nothing to run waits until woken by an arrival or by the
other lane's step end, or polls every IDLE_WAIT_S when the plan it waits on depends on time
(a paused batch, or nothing stepping while work exists) and the other lane's step does not hold
every unit, as the engine's condition timeout does.
On one event, lanes act prefill first.

Durations: a lane's step progresses at the rate the performance model predicts for the current
execution state, and the rate is re-evaluated whenever the other lane starts or ends a step, so
co-running contention applies exactly while both lanes run. Each step draws one noise factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bulletserve.executor.record import StepRecord
from bulletserve.perf.state import ExecutionState, fused_step_state
from bulletserve.sched.bullet import (
    BulletPolicy,
    BulletSnapshot,
    PrefillInFlight,
    Split,
)
from bulletserve.sim.device import CachedPerfModel, Noise
from bulletserve.sim.request import SimRequest
from bulletserve.sim.state import SimState

IDLE_WAIT_S = 0.005  # the engine's poll interval for a waiting lane while work exists
STALL_POLLS = 10_000  # consecutive polls with nothing stepping and nothing due: a stall
LANES = ("prefill", "decode")


@dataclass
class LaneStep:
    """A step in flight. `work_left` is the share still to run at time `since`; it runs at
    1/duration per second, duration being the prediction for the current state times noise."""

    requests: list[SimRequest]
    units: int
    noise: float
    started: float
    split: Split  # the plan's split the step started under (the step log's, as the engine's)
    layers: tuple[int, int] = (0, 0)
    # Decode: the requests' contexts when the step started. Prefill: each prompt's tokens in
    # the step's pass, and those in the KV cache before it.
    lengths: tuple[int, ...] = ()
    cached: tuple[int, ...] = ()
    work_left: float = 1.0
    since: float = 0.0
    duration: float = 0.0
    host_s: float = 0.0  # the engine's host time in the step, which contention does not stretch
    busy_s: float = 0.0  # noise-free time run so far, for the step log's predicted_s
    state: ExecutionState | None = None  # both lanes when the step started, for the step log
    # Decoding requests whose next token a prefill step computes too (the fused rules), and
    # their contexts when it started.
    fused: list[SimRequest] = field(default_factory=list)
    fused_ctx: tuple[int, ...] = ()

    @property
    def end(self) -> float:
        return self.since + self.work_left * self.duration


class LanedSimulator:
    def __init__(
        self,
        state: SimState,
        policy: BulletPolicy,
        perf: CachedPerfModel,
        noise: Noise,
        max_num_seqs: int,
        max_prefill_tokens: int,
    ) -> None:
        self.state, self.policy, self.perf, self.noise = state, policy, perf, noise
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.total = policy.units.total
        self.num_layers = policy.num_layers
        self.split = Split(0, self.total, "no-prefill")
        self.window = policy.latency_window()
        self.prefill_batch: list[SimRequest] | None = None
        self.layers_done = 0
        # The prefill batch's current pass: each prompt's tokens in it and cached before it.
        self.pass_tokens: tuple[int, ...] = ()
        self.pass_cached: tuple[int, ...] = ()
        self.steps: dict[str, LaneStep | None] = dict.fromkeys(LANES)
        self.wake_at: dict[str, float | None] = dict.fromkeys(LANES)  # None: not waiting
        self.ready = set(LANES)

    # ---- the event loop ---------------------------------------------------------------------

    def run(self) -> float:
        """Run every request to the end; returns the simulated time the last one finished."""
        now, idle_polls = 0.0, 0
        while True:
            if self.state.drain(now):
                self._notify()
            for lane in LANES:
                if lane in self.ready:
                    self._act(lane, now)
            if not (self.state.unfinished or self.prefill_batch is not None):
                return now
            stepping = [s.end for s in self.steps.values() if s is not None]
            arrival = self.state.next_arrival()
            polls = [t for t in self.wake_at.values() if t is not None and math.isfinite(t)]
            candidates = stepping + polls + ([arrival] if arrival is not None else [])
            idle_polls = idle_polls + 1 if not stepping and arrival is None else 0
            if not candidates or idle_polls > STALL_POLLS:
                self._fail("stalled: no lane can run and none arrive")
                return now
            now = max(now, min(candidates))
            for lane in LANES:
                step = self.steps[lane]
                if step is not None and step.end <= now:
                    self._end_step(lane, now)
            for lane, wake in self.wake_at.items():
                if wake is not None and wake <= now:
                    self.wake_at[lane] = None
                    self.ready.add(lane)

    def _notify(self) -> None:
        for lane, wake in self.wake_at.items():
            if wake is not None:
                self.wake_at[lane] = None
                self.ready.add(lane)

    def _wait(self, lane: str, now: float, time_dependent: bool) -> None:
        nothing_steps = all(s is None for s in self.steps.values())
        work = self.state.book.waiting or self.state.book.running or self.prefill_batch is not None
        other = self.steps["decode" if lane == "prefill" else "prefill"]
        # As in the engine: no polling while the other lane's step holds every unit (its end
        # wakes this lane).
        blocked = (
            self.policy.partition != "none" and other is not None and other.units >= self.total
        )
        poll = (time_dependent or (nothing_steps and work)) and not blocked
        self.wake_at[lane] = now + IDLE_WAIT_S if poll else math.inf

    def _fail(self, reason: str) -> None:
        for request in self.prefill_batch or ():
            request.error = reason
            self.state.book.release_blocks(request)
        self.prefill_batch = None
        self.state.fail_unfinished(reason)

    # ---- a lane's turn ----------------------------------------------------------------------

    def _snapshot(self, now: float) -> BulletSnapshot:
        prefill = None
        if self.prefill_batch is not None:
            views = tuple(r.view() for r in self.prefill_batch)
            stepping = self.steps["prefill"] is not None
            prefill = PrefillInFlight(views, self.layers_done, stepping)
        return BulletSnapshot(
            now=now,
            waiting=self.state.book.waiting_views(),
            prefill=prefill,
            decoding=self.state.book.running_views(),
            free_blocks=self.state.book.allocator.num_free,
            block_size=self.state.book.block_size,
            max_num_seqs=self.max_num_seqs,
            max_prefill_tokens=self.max_prefill_tokens,
            stats=self.window.stats(),
            split=self.split,
            corrections=self.perf.corrections,
        )

    def _act(self, lane: str, now: float) -> None:
        self.ready.discard(lane)
        if lane == "prefill":
            plan = self.policy.plan_prefill(self._snapshot(now))
            self.split = plan.split
            if plan.prefill is None or plan.split.prefill == 0:
                self._wait(lane, now, time_dependent=plan.prefill is not None)
                return
            units = plan.split.prefill or self.total
            if not self._fits(lane, units):
                self._wait(lane, now, time_dependent=False)
                return
            if plan.prefill.admitted:
                self._admit(plan.prefill.admitted)
            assert self.prefill_batch is not None
            if plan.prefill.layer_start == 0:
                self._begin_pass(plan.prefill.chunk)
            layers = (plan.prefill.layer_start, plan.prefill.layer_end)
            step = LaneStep(self.prefill_batch, units, self.noise.factor(), now, plan.split, layers)
            step.lengths, step.cached = self.pass_tokens, self.pass_cached
            by_id = {r.request_id: r for r in self.state.book.running}
            step.fused = [by_id[s.request_id] for s in plan.prefill.decode]
            for request in step.fused:
                self.state.book.grow_blocks(request, request.num_tokens)
            self._start(lane, step)
            return
        prefill_step = self.steps["prefill"]
        if prefill_step is not None and prefill_step.fused:
            # As the engine's decode lane: nothing to plan while a prefill step carries the rows.
            self._wait(lane, now, time_dependent=False)
            return
        plan = self.policy.plan_decode(self._snapshot(now))
        self.split = plan.split
        self.state.book.preempt(plan.preempted)
        units = plan.split.decode or self.total
        if not plan.decode or plan.split.decode == 0 or not self._fits(lane, units):
            self._wait(lane, now, time_dependent=bool(plan.decode))
            return
        by_id = {r.request_id: r for r in self.state.book.running}
        requests = [by_id[s.request_id] for s in plan.decode]
        for request in requests:
            self.state.book.grow_blocks(request, request.num_tokens)
        self._start(lane, LaneStep(requests, units, self.noise.factor(), now, plan.split))

    def _fits(self, lane: str, units: int) -> bool:
        """As the engine's lanes do: a step starts only on units the other lane's running step
        does not hold (without partitioning both lanes share every unit)."""
        other = self.steps["decode" if lane == "prefill" else "prefill"]
        return self.policy.partition == "none" or other is None or units + other.units <= self.total

    def _admit(self, admitted: tuple[str, ...]) -> None:
        requests = self.state.book.take_waiting(admitted)
        for request in requests:
            self.state.book.grow_blocks(request, request.num_tokens)
        self.prefill_batch = requests
        self.layers_done = 0

    def _begin_pass(self, chunk: int | None) -> None:
        """A pass over the layers: every prompt's rest, or the next `chunk` tokens of the one."""
        batch = self.prefill_batch or []
        self.pass_cached = tuple(r.num_computed_tokens for r in batch)
        if chunk is None:
            self.pass_tokens = tuple(r.num_tokens - r.num_computed_tokens for r in batch)
        else:
            self.pass_tokens = (chunk,)

    # ---- step timing ------------------------------------------------------------------------

    def _start(self, lane: str, step: LaneStep) -> None:
        step.since = step.started
        if lane == "decode":
            step.lengths = tuple(r.num_tokens for r in step.requests)
            sampled = len(step.requests)
        elif step.layers[1] == self.num_layers:
            completes = all(
                c + n == r.num_tokens
                for r, c, n in zip(step.requests, step.cached, step.lengths, strict=True)
            )
            sampled = (len(step.requests) if completes else 0) + len(step.fused)
        else:
            sampled = 0
        step.fused_ctx = tuple(r.num_tokens for r in step.fused)
        step.host_s = self.perf.host_s(sampled)
        self.steps[lane] = step
        step.state = self._execution_state()
        self._rerate(step.started)

    def _rerate(self, now: float) -> None:
        """Fold the time run so far into each step's progress, then set its rate for the state
        the lanes are in from now on."""
        es = self._execution_state()
        prediction = self.perf.predict(es)
        for lane, step in self.steps.items():
            if step is None:
                continue
            if step.duration > 0:
                ran = now - step.since
                step.work_left = max(0.0, step.work_left - ran / step.duration)
                step.busy_s += ran / step.noise
            step.since = now
            predicted = prediction.prefill_s if lane == "prefill" else prediction.decode_s
            step.duration = predicted * step.noise + step.host_s

    def _execution_state(self) -> ExecutionState:
        prefill, decode = self.steps["prefill"], self.steps["decode"]
        if prefill is not None and prefill.fused:
            # The decode lane is paused: one batch of the prompts and the decode rows.
            prompts = list(zip(prefill.lengths, prefill.cached, strict=True))
            return fused_step_state(prompts, list(prefill.fused_ctx), prefill.units)[0]
        start, end = prefill.layers if prefill else (0, self.num_layers)
        return ExecutionState(
            prefill_lens=prefill.lengths if prefill else (),
            prefill_cached=prefill.cached if prefill and any(prefill.cached) else (),
            prefill_units=prefill.units if prefill else 0,
            decode_ctx=decode.lengths if decode else (),
            decode_units=decode.units if decode else 0,
            prefill_layers=end - start,
            prefill_first_layer=start,
        )

    # ---- a step's end -----------------------------------------------------------------------

    def _end_step(self, lane: str, now: float) -> None:
        step = self.steps[lane]
        assert step is not None
        self._rerate(now)
        self.steps[lane] = None
        self._rerate(now)
        if lane == "prefill":
            self.layers_done = step.layers[1]
            if step.layers[1] == self.num_layers:
                for request, cached, tokens in zip(
                    step.requests, step.cached, step.lengths, strict=True
                ):
                    request.num_computed_tokens = cached + tokens
                if all(r.num_computed_tokens == r.num_tokens for r in step.requests):
                    self._finish_prefill(now)
                else:  # a chunk: the prompt's rest comes in later passes
                    self.layers_done = 0
            self._append_tokens(step.fused, now)
        else:
            self._append_tokens(step.requests, now)
        assert step.state is not None
        self.state.log_step(
            StepRecord(
                time=now,
                lane=lane,
                split=(step.split.prefill, step.split.decode),
                rule=step.split.rule,
                units=step.units,
                batch_size=len(step.requests),
                prefill_tokens=sum(step.lengths) if lane == "prefill" else 0,
                decode_rows=len(step.fused) if lane == "prefill" else len(step.requests),
                layers=step.layers if lane == "prefill" else None,
                state=step.state,
                predicted_s=step.busy_s,
                measured_s=now - step.started,
            )
        )
        self.ready.add(lane)
        self._notify()

    def _append_tokens(self, requests: list[SimRequest], now: float) -> None:
        """Decoding requests' next tokens, at a step's end."""
        for request in requests:
            request.num_computed_tokens = request.num_tokens
            if self.state.append_token(request, now):
                self._record_latency(request)

    def _record_latency(self, request: SimRequest) -> None:
        times = request.token_times
        if not times or request.finished_at is None:
            return
        tpot = (request.finished_at - times[0]) / (len(times) - 1) if len(times) > 1 else None
        self.window.finished(tpot)

    def _finish_prefill(self, now: float) -> None:
        batch, self.prefill_batch = self.prefill_batch or [], None
        for request in batch:
            request.num_computed_tokens = request.num_tokens
            self.state.book.running.append(request)
            if not request.token_times:  # not a recomputation after preemption
                self.window.first_token(now - request.arrival, request.input_len)
            if self.state.append_token(request, now):
                self._record_latency(request)
