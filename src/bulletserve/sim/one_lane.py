"""One lane: `SingleLane.step` on the virtual clock, for the chunked and prefill-first policies.

Each step: queue arrivals, snapshot, plan, apply preemptions, admit, grow blocks, run the batch
(its duration from the performance model on every unit), then count computed tokens and sample
the requests whose computed tokens reached their length. With nothing to run, the clock jumps to
the next arrival.
"""

from __future__ import annotations

from bulletserve.bookkeeping.single_step import (
    begin_single_step,
    end_single_step,
    scheduler_snapshot,
)
from bulletserve.sched.base import Policy
from bulletserve.sim.device import CachedPerfModel, Noise, step_elapsed_s, time_single_step
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
) -> float:
    """Run every request to the end on a device `slowdown` times slower than the model
    predicts (the host's time around each step after it, or with `host_overlap` beside it:
    `step_elapsed_s`); returns the simulated time the last one finished."""
    units = perf.hw.units
    now = 0.0
    while True:
        state.drain(now)
        if not state.unfinished:
            return now
        snapshot = scheduler_snapshot(state.book, now, max_num_seqs, max_num_batched_tokens)
        step = begin_single_step(state.book, policy.plan(snapshot))
        if not step.batch:
            arrival = state.next_arrival()
            if arrival is None:
                state.fail_unfinished("stalled: the policy schedules nothing and none arrive")
                return now
            now = max(now, arrival)
            continue
        timing = time_single_step(perf, noise, step, units, slowdown)
        end_single_step(state.book, step)
        now += step_elapsed_s(timing.measured_s, timing.host_s, host_overlap)
        for request in step.sampled():
            state.append_token(request, now)
        record = step.record(now, units, timing.state, timing.measured_s, timing.predicted_s)
        state.log_step(record)
