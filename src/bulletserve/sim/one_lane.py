"""One lane: `SingleLane.step` on the virtual clock, for the chunked and prefill-first policies.

Each step: queue arrivals, snapshot, plan, apply preemptions, admit, grow blocks, run the batch
(its duration from the performance model on every unit), then count computed tokens and sample
the requests whose computed tokens reached their length. With nothing to run, the clock jumps to
the next arrival. Under speculative decoding (`speculation`) drafts are offered before the
snapshot, and a verified row makes its accepted drafts and one token more, as the engine's.
"""

from __future__ import annotations

from functools import partial

from bulletserve.bookkeeping.single_step import (
    begin_single_step,
    end_single_step,
    scheduler_snapshot,
)
from bulletserve.sched.base import Policy
from bulletserve.sim.device import CachedPerfModel, Noise, step_elapsed_s, time_single_step
from bulletserve.sim.request import SimRequest
from bulletserve.sim.speculation import SimSpeculation
from bulletserve.sim.state import SimState


def run_single_lane(
    state: SimState,
    policy: Policy,
    perf: CachedPerfModel,
    noise: Noise,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    slowdown: float = 1.0,
    host_overlap: bool = False,
    speculation: SimSpeculation | None = None,
) -> float:
    """Run every request to the end on a device `slowdown` times slower than the model
    predicts (the host's time around each step after it, or with `host_overlap` beside it:
    `step_elapsed_s`); returns the simulated time the last one finished."""
    units = perf.hw.units
    now = 0.0
    host_s = 0.0  # the last step's, as the engine measures its own for the draft rule
    # The draft rule plans by the model's corrected estimates, as the engine's step feeds them.
    corrects = speculation is not None and speculation.config.adaptive
    while True:
        state.drain(now)
        if not state.unfinished:
            return now
        if speculation is not None:
            speculation.propose(state.book.running)
        snapshot = scheduler_snapshot(state.book, now, max_num_seqs, max_num_batched_tokens, host_s)
        step = begin_single_step(state.book, policy.plan(snapshot))
        if not step.batch:
            arrival = state.next_arrival()
            if arrival is None:
                state.fail_unfinished("stalled: the policy schedules nothing and none arrive")
                return now
            now = max(now, arrival)
            continue
        timing = time_single_step(perf, noise, step, units, slowdown)
        now += step_elapsed_s(timing.measured_s, timing.host_s, host_overlap)
        host_s = timing.host_s
        if corrects:
            phase = "prefill" if timing.state.has_prefill else "decode"
            perf.observe(timing.state, phase, timing.measured_s)
        rejected: dict[str, int] = {}
        accepted = None
        if speculation is not None:
            accepted = 0
            rows = [(request, num - 1) for request, num in step.batch]
            for request, drafts, held in speculation.verify(rows):
                rejected[request.request_id] = drafts - held
                accepted += held
                for _ in range(held + 1):
                    if state.append_token(request, now):
                        break
        end_single_step(state.book, step, _finished, partial(_rejected, rejected))
        for request in step.sampled():
            state.append_token(request, now)
        record = step.record(
            now, units, timing.state, timing.measured_s, timing.predicted_s, accepted
        )
        state.log_step(record)


def _finished(request: SimRequest) -> bool:
    return request.finished_at is not None


def _rejected(rejected: dict[str, int], request: SimRequest) -> int:
    return rejected.get(request.request_id, 0)
