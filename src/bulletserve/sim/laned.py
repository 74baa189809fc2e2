"""Two lanes: the laned engine's state machine (`executor.lanes.LaneCore`, the engine's own) on
the virtual clock, for the Bullet policy.

Each lane acts as the engine's lane threads do: with no work it waits; else it plans (the plan's
split comes into force) and starts its step if the plan gives it one it can start now, or waits
(`LaneCore.wait_s`: a poll while it has work and the other lane leaves it units, else until
woken by an arrival or the other lane's step end). At a step's end the lane updates the state
and wakes the other lane. On one event, lanes act prefill first.

Durations: a lane's step progresses at the rate the performance model predicts for what runs on
the device, re-evaluated whenever the other lane starts or ends a step, so co-running
contention applies exactly while both lanes run. Each step draws one noise factor.

On a device slower or faster than the model believes (`slowdown` other than 1), each step's
modeled time feeds the policy's online correction as the engine feeds it each measured step
(`PerfModel.observe`). At 1 there is nothing to learn: the device runs at the model's
predictions (the engine on the simulator's virtual clock does not observe either).

Under speculative decoding (`speculation`) the decode lane offers drafts before it plans, and a
verified row makes its accepted drafts and one token more at its step's end, as the engine's.
"""

from __future__ import annotations

from bulletserve.bookkeeping.lane_core import LANES, LaneCore
from bulletserve.bookkeeping.record import Lane
from bulletserve.sched.bullet import BulletPolicy
from bulletserve.sim.device import CachedPerfModel, ModeledLanes, Noise
from bulletserve.sim.request import SimRequest
from bulletserve.sim.speculation import SimSpeculation
from bulletserve.sim.state import SimState

STALL_POLLS = 10_000  # consecutive polls with nothing stepping and nothing due: a stall


class LanedSimulator:
    def __init__(
        self,
        state: SimState,
        policy: BulletPolicy,
        perf: CachedPerfModel,
        noise: Noise,
        max_num_seqs: int,
        max_prefill_tokens: int,
        slowdown: float = 1.0,
        host_overlap: bool = False,
        speculation: SimSpeculation | None = None,
    ) -> None:
        self.state, self.perf, self.noise = state, perf, noise
        self.speculation = speculation
        self.core: LaneCore[SimRequest] = LaneCore(
            state.book, policy, max_num_seqs, max_prefill_tokens
        )
        self.device = ModeledLanes(self.core, perf, noise, slowdown, host_overlap)
        self.learns = slowdown != 1.0
        self.wake_at: dict[Lane, float | None] = dict.fromkeys(LANES)  # None: not waiting
        self.ready: set[Lane] = set(LANES)

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
            if not (self.state.unfinished or self.core.prefill is not None):
                return now
            stepping = [t.end for t in self.device.timing.values() if t is not None]
            arrival = self.state.next_arrival()
            polls = [t for t in self.wake_at.values() if t is not None]
            candidates = stepping + polls + ([arrival] if arrival is not None else [])
            idle_polls = idle_polls + 1 if not stepping and arrival is None else 0
            if not candidates or idle_polls > STALL_POLLS:
                self._fail("stalled: no lane can run and none arrive")
                return now
            now = max(now, min(candidates))
            for lane in LANES:
                timing = self.device.timing[lane]
                if timing is not None and timing.end <= now:
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

    def _wait(self, lane: Lane, now: float) -> None:
        self.wake_at[lane] = now + self.core.wait_s(lane)

    def _fail(self, reason: str) -> None:
        book = self.state.book
        book.busy.clear()
        for request in self.core.prefill.requests if self.core.prefill else ():
            request.error = reason
            book.release_blocks(request)
        self.core.prefill = None
        self.state.fail_unfinished(reason)

    # ---- a lane's turn ----------------------------------------------------------------------

    def _act(self, lane: Lane, now: float) -> None:
        self.ready.discard(lane)
        core = self.core
        if not core.may_plan(lane):
            self._wait(lane, now)
            return
        if lane == "decode" and self.speculation is not None:
            self.speculation.propose(core.book.running)
        plan = core.plan(lane, now, self.perf.corrections)
        if lane == "decode":
            core.book.preempt(plan.preempted)
        if not core.runnable(lane, plan):
            self._wait(lane, now)
            return
        step = core.start_prefill(plan) if lane == "prefill" else core.start_decode(plan)
        self.device.start(step, now)

    # ---- a step's end -----------------------------------------------------------------------

    def _end_step(self, lane: Lane, now: float) -> None:
        timing = self.device.end(lane, now)
        verified: list[tuple[SimRequest, int, int]] = []
        running = self.core.steps[lane]
        if lane == "decode" and self.speculation is not None and running is not None:
            verified = self.speculation.verify(
                zip(running.requests, running.row_drafts, strict=True)
            )
        rejected = {request.request_id: count - held for request, count, held in verified}
        step = self.core.end_step(lane, lambda request: rejected.get(request.request_id, 0))
        self.device.rerate(now)
        if self.learns:
            # What the policy predicted (under the corrections it planned with) against what
            # the device took, as the engine's lanes see each measured step.
            measured = now - timing.started - timing.host_s
            prediction = self.perf.predict(step.state)
            predicted = prediction.prefill_s if lane == "prefill" else prediction.decode_s
            self.core.window.step(predicted, measured)
            self.perf.observe(step.state, lane, measured)
        if lane == "prefill" and step.layers[1] == self.core.num_layers:
            ended = self.core.end_pass(lambda request: False)
            for request in ended.joined:
                if not request.token_times:  # not a recomputation after preemption
                    self.core.window.first_token(
                        now - request.arrival, request.input_len, request.slo
                    )
            self._append_tokens(ended.sampled, now)
        elif lane == "decode":
            held = {request.request_id: accepted for request, _, accepted in verified}
            for request in step.requests:
                # A verified row's accepted drafts, then its one token more.
                for _ in range(held.get(request.request_id, 0)):
                    if self._append_tokens([request], now):
                        break
                else:
                    self._append_tokens([request], now)
        accepted = None
        if self.speculation is not None and lane == "decode":
            accepted = sum(held for _, _, held in verified)
        record = step.record(now, now - timing.started, timing.busy_s, accepted_tokens=accepted)
        self.state.log_step(record)
        self.ready.add(lane)
        self._notify()

    def _append_tokens(self, requests: list[SimRequest], now: float) -> bool:
        """The requests' next tokens, at a step's end; whether one of them finished."""
        finished = False
        for request in requests:
            if self.state.append_token(request, now):
                finished = True
                times = request.token_times
                tpot = (now - times[0]) / (len(times) - 1) if len(times) > 1 else None
                self.core.window.finished(tpot, request.slo)
        return finished
